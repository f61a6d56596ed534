//! ntb
