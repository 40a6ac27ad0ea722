"""The prepared-launch core every op shares: signatures, plan caches and dispatch
(``prepared``), the argument block and the launcher (``launch``), the driver, and the checks on
arrays, layouts and declarations."""
