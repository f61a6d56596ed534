//! A child process's stdout captured line by line (with arrival times) and its stderr, for
//! tests that wait on a guest console: the `lendvm` runs of the test guest and of Linux.

use std::io::{BufRead, BufReader, Read};
use std::process::Child;
use std::sync::{Arc, Condvar, Mutex, MutexGuard};
use std::thread::JoinHandle;
use std::time::{Duration, Instant};

#[derive(Default)]
struct Lines {
    /// (time since capture started, line without its `\n`/`\r`)
    lines: Vec<(Duration, String)>,
    /// stdout reached end of file.
    closed: bool,
}

/// Output of one child process, read by two background threads.
pub struct ProcessOutput {
    stdout: Arc<(Mutex<Lines>, Condvar)>,
    stderr: Arc<Mutex<String>>,
    stderr_reader: Option<JoinHandle<()>>,
    started: Instant,
}

fn lock<T>(m: &Mutex<T>) -> MutexGuard<'_, T> {
    m.lock().unwrap_or_else(|e| e.into_inner())
}

impl ProcessOutput {
    /// Takes the child's piped stdout and stderr (a stream that was not piped stays empty).
    pub fn capture(child: &mut Child) -> Self {
        let started = Instant::now();
        let stdout = Arc::new((Mutex::new(Lines::default()), Condvar::new()));
        let shared = stdout.clone();
        let out = child.stdout.take();
        std::thread::spawn(move || {
            if let Some(out) = out {
                let mut r = BufReader::new(out);
                let mut buf = Vec::new();
                loop {
                    buf.clear();
                    match r.read_until(b'\n', &mut buf) {
                        Ok(0) | Err(_) => break,
                        Ok(_) => {
                            // Lossy: a guest may print bytes that are not UTF-8.
                            let line = String::from_utf8_lossy(&buf)
                                .trim_end_matches(['\n', '\r'])
                                .to_string();
                            let (m, cv) = &*shared;
                            lock(m).lines.push((started.elapsed(), line));
                            cv.notify_all();
                        }
                    }
                }
            }
            let (m, cv) = &*shared;
            lock(m).closed = true;
            cv.notify_all();
        });
        let stderr = Arc::new(Mutex::new(String::new()));
        let text = stderr.clone();
        let err = child.stderr.take();
        let stderr_reader = std::thread::spawn(move || {
            let Some(mut err) = err else { return };
            let mut buf = [0u8; 4096];
            while let Ok(n) = err.read(&mut buf) {
                if n == 0 {
                    break;
                }
                lock(&text).push_str(&String::from_utf8_lossy(&buf[..n]));
            }
        });
        ProcessOutput {
            stdout,
            stderr,
            stderr_reader: Some(stderr_reader),
            started,
        }
    }

    /// When the capture (and so, about, the process) started.
    pub fn started(&self) -> Instant {
        self.started
    }

    /// Whether stdout has reached its end (the process closed it, or exited).
    pub fn closed(&self) -> bool {
        lock(&self.stdout.0).closed
    }

    /// The stdout lines so far with their arrival times.
    pub fn timed_lines(&self) -> Vec<(Duration, String)> {
        lock(&self.stdout.0).lines.clone()
    }

    /// The stdout lines so far.
    pub fn lines(&self) -> Vec<String> {
        lock(&self.stdout.0)
            .lines
            .iter()
            .map(|(_, l)| l.clone())
            .collect()
    }

    /// Everything written to stderr so far.
    pub fn stderr(&self) -> String {
        lock(&self.stderr).clone()
    }

    /// The stdout lines so far, each prefixed with its arrival time in seconds.
    pub fn timed_console(&self) -> String {
        self.timed_lines()
            .iter()
            .map(|(t, l)| format!("{:7.2} {l}\n", t.as_secs_f64()))
            .collect()
    }

    /// A failure report: the ends first (whether the process is gone, the console's last 40
    /// lines, stderr's last 40, then each of `extra`: a title and its text, already cut),
    /// the whole console last. CI keeps the head of a long failure output, and a Linux
    /// boot's console is some 250 lines before the part that tells why a guest stopped.
    pub fn report(&self, extra: &[(&str, String)]) -> String {
        let console = self.timed_console();
        let state = if self.closed() {
            "the console has closed (the process exited)"
        } else {
            "the process still runs"
        };
        let mut out = format!(
            "--- {state}; console, last 40 lines (wall s since start, then the guest's own)\n{}\n\
             --- stderr, last 40 lines\n{}\n",
            last_lines(&console, 40),
            last_lines(&self.stderr(), 40)
        );
        for (title, text) in extra {
            out.push_str(&format!("--- {title}\n{text}\n"));
        }
        out.push_str(&format!("--- the whole console\n{console}"));
        out
    }

    /// Waits until `find` returns something for the lines seen so far; `None` at `deadline`
    /// or once stdout has closed without a match.
    pub fn wait_for<T>(
        &self,
        deadline: Instant,
        mut find: impl FnMut(&[(Duration, String)]) -> Option<T>,
    ) -> Option<T> {
        let (m, cv) = &*self.stdout;
        let mut c = lock(m);
        loop {
            if let Some(found) = find(&c.lines) {
                return Some(found);
            }
            let now = Instant::now();
            if c.closed || now >= deadline {
                return None;
            }
            c = cv
                .wait_timeout(c, deadline - now)
                .unwrap_or_else(|e| e.into_inner())
                .0;
        }
    }

    /// After the process exited: lets the readers drain the pipes (stdout bounded by
    /// `timeout`), so `lines()` and `stderr()` then hold everything.
    pub fn drain(&mut self, timeout: Duration) {
        let (m, cv) = &*self.stdout;
        let c = lock(m);
        drop(cv.wait_timeout_while(c, timeout, |c| !c.closed));
        // The process has exited and has no children, so its stderr pipe is closed and the
        // reader ends: joining cannot hang.
        if let Some(reader) = self.stderr_reader.take() {
            let _ = reader.join();
        }
    }
}

/// The last `n` lines of `text`.
pub fn last_lines(text: &str, n: usize) -> String {
    let lines: Vec<&str> = text.lines().collect();
    lines[lines.len().saturating_sub(n)..].join("\n")
}
