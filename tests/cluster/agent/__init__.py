"""A test node agent: a kubelet stand-in that really runs the containers' commands (a test harness in
the spirit of KWOK's fake kubelets, not a product).

It registers one Node, binds every unscheduled pod to it (there is no kube-scheduler in this tier;
the agent stands in for it), and runs each pod bound to it in its own network namespace (a veth on
the node namespace's bridge) and its own mount namespace (volumes, ConfigMaps, Secrets and image
paths bind-mounted from local directories), with the images it knows mapped to this machine's venv
(images.py). The machine's own network namespace carries only loopback traffic: the bridge, the
veths and every pod address live in namespaces the agent creates, and pods reach the API server
through a relay (relay.py) listening on the `kubernetes` Service's cluster IP inside the node
namespace. With no CNI here, the agent also does a CNI's policy work (netpol.py): it enforces the
NetworkPolicies' ingress rules with one nftables table in the node namespace, rewritten whole when a
policy, pod or namespace changes. Layout and limits: README.md beside this package.
"""
