//! lending
