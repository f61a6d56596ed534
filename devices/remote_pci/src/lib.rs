//! remote_pci
