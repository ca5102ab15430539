"""An emulated aarch64 device for benchmarks: a Debian arm64 root file system run under QEMU."""
