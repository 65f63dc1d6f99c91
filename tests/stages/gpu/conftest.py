"""The GPU tests run cuBLAS without a workspace, as a deterministic engine does (stages/row_invariant_products.py):
older torch reads the setting once per process, at its first product, so it is set before any test runs one."""

from stages import row_invariant_products


def pytest_configure(config):
    row_invariant_products.use_no_workspace()
