"""`python -m dsv4_engine.kernels`: build the fused CPU kernels now (`build.main`)."""

import sys

from dsv4_engine.kernels.build import main

sys.exit(main())
