"""FailBench-Ray: fault-tolerance mechanisms for distributed training, measured side by side."""

__version__ = "0.1.0"

# A local cluster keeps to loopback because `runtime.connect()` applies Ray's setting where it
# starts the cluster, whatever imported Ray first (README: Networking).
