//! The fault-injection harness's pieces that need no cluster (issue 34): the history format
//! ([`history`]), the checker that decides a history ([`check`]) and seeded fault schedules
//! ([`schedule`]), and the lenders' audit logs read into the history ([`audit`]). `lendvm-chaos` (`tests/src/bin/lendvm-chaos.rs`) puts them on a command
//! line. docs/RELIABILITY.md ("A cluster under fire") says what is built and what is not.

pub mod audit;
pub mod check;
pub mod history;
pub mod recorder;
pub mod schedule;

#[cfg(test)]
mod check_tests;
