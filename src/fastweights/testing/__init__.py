"""What the test suite and the benchmark scripts both run, so that neither imports the other's folder: the
registered components at the registry-wide contracts' dimensions (``registry_cases``), the device contract's
construction, calls and training steps (``device_contract``: ``tests/contracts/test_device_contract.py`` on the
CPU, ``benchmarks/gpu/cuda_check.py`` on a GPU against the CPU through ``device_check``), a tiny offline Llama
(``tiny_models``), and a stand-in for flash-linear-attention's delta-rule kernels
(``fla_standin``: the fla dispatch's tests, the GPU queue's dry run)."""
