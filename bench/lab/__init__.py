"""fedge's edge lab: an emulated fleet of slow, memory-capped, intermittently connected devices on one
Linux machine, limited by the kernel (cgroups, network namespaces, tc). ``bench/edge_lab.py`` runs it;
docs/edge-lab.md describes it."""
