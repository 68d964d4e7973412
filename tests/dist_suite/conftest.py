"""pytest: run only the tests a module selects in its SELECTED_TESTS (see run_dist_suite.py,
which reads them from tests.txt); everything else torch's DistributedTest defines is deselected."""


def pytest_collection_modifyitems(config, items):
    keep, drop = [], []
    for item in items:
        module = getattr(item, "module", None)
        selected = getattr(module, "SELECTED_TESTS", None)
        (drop if selected is not None and item.name not in selected else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep
