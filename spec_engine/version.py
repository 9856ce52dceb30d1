"""The engine version reported by get_server_info and /get_server_info."""

__version__ = "0.1.0"
