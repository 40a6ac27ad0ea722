"""The ``rope-rtc`` subcommands that are more than a call into the library: ``info`` and ``cache``
(``rope_rtc.cli`` parses the command line and dispatches to them)."""
