"""The cuttable TCP proxy lives in `bench/tcpproxy.py` (the bench's soak cuts the database the
same way); the tests keep importing it from here."""

from bench.tcpproxy import Proxy

__all__ = ["Proxy"]
