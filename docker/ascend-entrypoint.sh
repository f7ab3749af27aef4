#!/bin/bash
# dsv4 on Ascend: CANN's environment, then the engine. The engine-ascend image's ENTRYPOINT, and the
# command the operator renders for device npu (`dsv4-ascend serve ...`).
#
# torch_npu loads libascendcl & co. when it is imported, so LD_LIBRARY_PATH, ASCEND_OPP_PATH and the
# rest must be set before Python starts; CANN's set_env.sh sets them. CANN 9 installs it at
# $ASCEND/cann/set_env.sh (torch_npu 2.14.0's README), earlier releases and images that keep the old
# layout at $ASCEND/ascend-toolkit/set_env.sh; ATB's (nnal), which torch_npu's libop_plugin_atb
# loads, is sourced where it is installed. The driver's libraries come from the node: the pod mounts
# $ASCEND/driver. DSV4_ASCEND_ROOT moves $ASCEND from /usr/local/Ascend (non-default installs, tests).
#
# No `set -e`/`-u`: the set_env scripts run commands that may fail and read variables that may be unset.
ascend=${DSV4_ASCEND_ROOT:-/usr/local/Ascend}

toolkit=
for candidate in "$ascend/cann/set_env.sh" "$ascend/ascend-toolkit/set_env.sh"; do
    if [ -f "$candidate" ]; then
        toolkit=$candidate
        break
    fi
done
if [ -z "$toolkit" ]; then
    echo "dsv4-ascend: no CANN set_env.sh in $ascend/cann or $ascend/ascend-toolkit: not a CANN image?" >&2
    exit 2
fi
# shellcheck source=/dev/null
source "$toolkit"
if [ -f "$ascend/nnal/atb/set_env.sh" ]; then
    # shellcheck source=/dev/null
    source "$ascend/nnal/atb/set_env.sh"
fi
driver=$ascend/driver/lib64
export LD_LIBRARY_PATH="$driver:$driver/common:$driver/driver${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"

exec dsv4 "$@"
