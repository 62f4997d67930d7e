"""runtime: process plumbing shared by `burst train`, `burst eval` and `burst bench`.

launch.py starts local worker processes (or finds torchrun's), process.py makes this process a rank
(device, process group, all-reduce), memory.py measures peak memory. Imports burst only for its
group helpers; imports no other project package.
"""
