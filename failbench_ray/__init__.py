"""FailBench-Ray: fault-tolerance mechanisms for distributed training, measured side by side."""

import os

__version__ = "0.1.0"

# Ray reads this when it is first imported: with "0", every Ray process of a local cluster binds
# and advertises 127.0.0.1 instead of the machine's external address. Only for local clusters:
# a driver that joins a remote cluster (RAY_ADDRESS) must advertise its real address.
if not os.environ.get("RAY_ADDRESS"):
    os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
