//! The guest's reruns of a process that the emulator killed, checked against the kernel.
//!
//! On this project's hosts the guest runs in KVM's instruction emulator, and now and then a
//! freshly started user process dies on its first TLS access (`segfault at 0 ip 4a4d02`, or
//! `general protection fault` with a garbage FS base: docs/linux-guest-on-pvm.md). The
//! guest's `/init` runs such a process again (`flaky`) and prints
//! `LENDVM-FLAKE <cmd> ...` for each rerun (and for each retried early mount). A rerun is
//! only acceptable when the kernel reported a fault of that kind before it: otherwise a
//! process that lendvm's own bug killed (or a mount that failed for a real reason) would
//! pass unseen. [`check`] enforces that on a whole console and says how many reruns there
//! were, so that a test's output counts them.

/// A kernel report of a user process killed by a fault, as the guest kernel prints it
/// (`exe[41]: segfault at 0 ip ...`, `traps: fio[58] general protection fault ip:...`).
fn is_fault_report(line: &str) -> bool {
    line.contains("]: segfault at ") || line.contains(" general protection fault ip:")
}

/// Checks every `LENDVM-FLAKE` line of `lines` against the kernel's fault reports: each
/// rerun needs a report of its own before it. Returns the number of reruns, or an error
/// naming the first rerun that has none.
pub fn check(lines: &[String]) -> Result<usize, String> {
    let (mut faults, mut flakes) = (0usize, 0usize);
    for (i, line) in lines.iter().enumerate() {
        if is_fault_report(line) {
            faults += 1;
        } else if line.contains("LENDVM-FLAKE") {
            flakes += 1;
            if flakes > faults {
                return Err(format!(
                    "console line {}: {line:?} reruns a process, but the kernel reported \
                     only {faults} user-space fault(s) before it ({flakes} reruns so far): \
                     something other than the emulator's TLS fault made it fail",
                    i + 1
                ));
            }
        }
    }
    Ok(flakes)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lines(l: &[&str]) -> Vec<String> {
        l.iter().map(|s| s.to_string()).collect()
    }

    #[test]
    fn a_rerun_after_a_reported_fault_is_counted() {
        let c = lines(&[
            "[    4.1] exe[41]: segfault at 0 ip 00000000004a4d02 sp 00007ffd error 4 in busybox",
            "LENDVM-FLAKE dd rc=139 attempt=1: died by signal 11, run again",
            "[   90.2] traps: fio[58] general protection fault ip:495022 sp:7ffe error:0 in fio",
            "LENDVM-FLAKE fio rc=139 attempt=1: died by signal 11, run again",
        ]);
        assert_eq!(check(&c), Ok(2));
        assert_eq!(check(&lines(&["LENDVM-FIO done runs=1 failed=0"])), Ok(0));
    }

    #[test]
    fn a_rerun_without_a_fault_report_is_an_error() {
        let c = lines(&[
            "LENDVM-FLAKE mount -t devtmpfs /dev: attempt 1 failed",
            "[    4.1] exe[41]: segfault at 0 ip 00000000004a4d02 sp 00007ffd error 4",
        ]);
        let e = check(&c).unwrap_err();
        assert!(e.contains("console line 1"), "{e}");
        // One report does not cover two reruns.
        let c = lines(&[
            "[    4.1] exe[41]: segfault at 0 ip 00000000004a4d02 sp 00007ffd error 4",
            "LENDVM-FLAKE dd rc=139 attempt=1: died by signal 11, run again",
            "LENDVM-FLAKE dd rc=139 attempt=2: died by signal 11, run again",
        ]);
        assert!(check(&c).unwrap_err().contains("console line 3"));
    }
}
