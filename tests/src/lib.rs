//! Integration tests for lendvm live in tests/tests.
