"""The inference engine shared by the prefill and decode services.

Importing this package is cheap (no torch): heavy modules are imported where used.
"""
