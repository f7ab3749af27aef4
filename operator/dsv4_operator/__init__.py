"""dsv4 operator: the Dsv4Deployment spec, its plan, and the drivers that realise it."""
