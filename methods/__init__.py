"""Learning methods, one folder each.

A folder holds everything of its method: the coordinator's strategy and its config
sections (``strategy.py``), and, for methods that need them, the device's objectives
(``device.py``), the model hook that changes the networks every party builds (``model.py``),
the export hook (``export.py``), its ``fedge-coordinator`` commands (``cli.py``) and whatever
else only it uses (``diagnostics.py``, ``matching.py``). Helpers several methods share are in
``common.py``. One entry in ``edge_client/registry.py`` wires a folder in; ``docs/methods.md``
walks through adding one.

A file's floor follows its role, not its folder: ``device.py``, ``model.py`` and ``common.py``
stand on the device package's floor (devices import them), ``export.py`` on the export's, the
rest on the coordinator's (``tests/test_layout.py`` checks it).
"""
