//! emulated
