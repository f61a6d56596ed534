//! What `lenderd` and `lendvm` share on their command lines: `--config FILE` (a TOML file
//! whose keys are the long options) and the generated man page and shell completions.
//!
//! A config file is turned into options placed before those of the command line, which
//! override them (a repeatable option adds to the file's list), so a key means exactly what
//! its option means and is validated by the same parser. A key that is no option is an
//! error naming it; a file that group or others can write is refused (it decides which
//! devices are lent and where secrets are read from).

use std::ffi::OsString;
use std::io::{self, Read};
use std::os::unix::fs::{MetadataExt, OpenOptionsExt, PermissionsExt};
use std::path::{Path, PathBuf};

use clap::ArgAction;
use thiserror::Error;

/// Errors of `--config`.
#[derive(Debug, Error)]
pub enum ConfigFileError {
    /// Cannot read it.
    #[error("config file {path}: {source}")]
    Read {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: io::Error,
    },
    /// Writable by group or others.
    #[error(
        "config file {path} is writable by group or others (mode {mode:o}); refusing it \
         (chmod go-w {path})"
    )]
    Writable {
        /// The file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// A symbolic link (not followed: the file itself must be given).
    #[error(
        "config file {path} is a symbolic link; refusing to follow it (give the file it points \
         to)"
    )]
    Symlink {
        /// The file.
        path: PathBuf,
    },
    /// Holds the cluster token and is readable by group or others.
    #[error(
        "config file {path} holds the cluster token and is readable by group or others (mode \
         {mode:o}); refusing it (chmod 600 {path})"
    )]
    SecretReadable {
        /// The file.
        path: PathBuf,
        /// Its permission bits.
        mode: u32,
    },
    /// Holds the cluster token and belongs to another user than the daemon's (or root).
    #[error(
        "config file {path} holds the cluster token and belongs to uid {uid}, not to this \
         daemon's user (uid {euid}) or root; refusing it"
    )]
    SecretOwner {
        /// The file.
        path: PathBuf,
        /// Its owner.
        uid: u32,
        /// The daemon's effective user.
        euid: u32,
    },
    /// Not TOML.
    #[error("config file {path}: {source}")]
    Parse {
        /// The file.
        path: PathBuf,
        /// Why.
        #[source]
        source: toml::de::Error,
    },
    /// A key that is no option.
    #[error("config file {path}: unknown key `{key}` (known keys: {known})")]
    UnknownKey {
        /// The file.
        path: PathBuf,
        /// The key.
        key: String,
        /// The keys it takes.
        known: String,
    },
    /// A value of the wrong shape.
    #[error("config file {path}: key `{key}`: {what}")]
    BadValue {
        /// The file.
        path: PathBuf,
        /// The key.
        key: String,
        /// What is wrong.
        what: String,
    },
    /// `--config` without a value.
    #[error("--config needs a file")]
    NoFile,
}

/// The options `path` stands for, for `cmd`.
pub fn config_args(cmd: &clap::Command, path: &Path) -> Result<Vec<OsString>, ConfigFileError> {
    let read_error = |source| ConfigFileError::Read {
        path: path.to_path_buf(),
        source,
    };
    // Opened once, not followed if it is a symbolic link, and checked on the opened file:
    // what is checked is what is read (a path checked, then re-opened, may be swapped).
    let mut file = std::fs::OpenOptions::new()
        .read(true)
        .custom_flags(libc::O_NOFOLLOW | libc::O_CLOEXEC)
        .open(path)
        .map_err(|source| match source.raw_os_error() {
            Some(libc::ELOOP) => ConfigFileError::Symlink {
                path: path.to_path_buf(),
            },
            _ => read_error(source),
        })?;
    let meta = file.metadata().map_err(read_error)?;
    let mode = meta.permissions().mode() & 0o7777;
    if mode & 0o022 != 0 {
        return Err(ConfigFileError::Writable {
            path: path.to_path_buf(),
            mode,
        });
    }
    let mut text = String::new();
    file.read_to_string(&mut text).map_err(read_error)?;
    let table: toml::Table = text.parse().map_err(|source| ConfigFileError::Parse {
        path: path.to_path_buf(),
        source,
    })?;
    // A file that holds the cluster token is a secret: nobody but its owner may read it, and
    // its owner is the daemon's user or root.
    if table.contains_key("token") {
        if mode & 0o044 != 0 {
            return Err(ConfigFileError::SecretReadable {
                path: path.to_path_buf(),
                mode,
            });
        }
        // SAFETY: geteuid takes no arguments and cannot fail.
        let euid = unsafe { libc::geteuid() };
        if meta.uid() != euid && meta.uid() != 0 {
            return Err(ConfigFileError::SecretOwner {
                path: path.to_path_buf(),
                uid: meta.uid(),
                euid,
            });
        }
    }
    let args: Vec<&clap::Arg> = cmd
        .get_arguments()
        .filter(|a| {
            a.get_long()
                .is_some_and(|l| !matches!(l, "config" | "help" | "version"))
        })
        .collect();
    // The key a file uses for each option: `devices` for the repeatable `--device`.
    let known = || {
        args.iter()
            .filter_map(|a| {
                let l = a.get_long()?.replace('-', "_");
                Some(match a.get_action() {
                    ArgAction::Append if !l.ends_with('s') => format!("{l}s"),
                    _ => l,
                })
            })
            .collect::<Vec<_>>()
            .join(", ")
    };
    let named = |a: &clap::Arg, long: &str| {
        a.get_long() == Some(long) || a.get_all_aliases().is_some_and(|v| v.contains(&long))
    };
    let mut out = Vec::new();
    for (key, value) in &table {
        let long = key.replace('_', "-");
        let arg = args
            .iter()
            .find(|a| named(a, long.as_str()))
            .or_else(|| {
                // `devices = [...]` for the repeatable `--device`.
                long.strip_suffix('s').and_then(|one| {
                    args.iter()
                        .find(|a| named(a, one) && matches!(a.get_action(), ArgAction::Append))
                })
            })
            .ok_or_else(|| ConfigFileError::UnknownKey {
                path: path.to_path_buf(),
                key: key.clone(),
                known: known(),
            })?;
        let flag = format!("--{}", arg.get_long().unwrap_or_default());
        let bad = |what: &str| ConfigFileError::BadValue {
            path: path.to_path_buf(),
            key: key.clone(),
            what: what.to_string(),
        };
        let scalar = |v: &toml::Value| -> Result<String, ConfigFileError> {
            match v {
                toml::Value::String(s) => Ok(s.clone()),
                toml::Value::Integer(i) => Ok(i.to_string()),
                toml::Value::Float(f) => Ok(f.to_string()),
                _ => Err(bad("expected a string or a number")),
            }
        };
        match (arg.get_action(), value) {
            (ArgAction::SetTrue, toml::Value::Boolean(b)) => {
                if *b {
                    out.push(OsString::from(flag));
                }
            }
            (ArgAction::SetTrue, _) => return Err(bad("expected true or false")),
            (ArgAction::Append, toml::Value::Array(items)) => {
                for v in items {
                    out.push(OsString::from(&flag));
                    out.push(OsString::from(scalar(v)?));
                }
            }
            (ArgAction::Append, v) | (ArgAction::Set, v) => {
                out.push(OsString::from(&flag));
                out.push(OsString::from(scalar(v)?));
            }
            _ => return Err(bad("this option cannot be set from a file")),
        }
    }
    Ok(out)
}

/// `argv` with the options of its `--config FILE` (if any) inserted after the program name,
/// so that the command line's own options override them.
pub fn expand_config(
    cmd: &clap::Command,
    argv: Vec<OsString>,
) -> Result<Vec<OsString>, ConfigFileError> {
    let mut file = None;
    let mut rest = Vec::with_capacity(argv.len());
    let mut it = argv.into_iter();
    let program = it.next();
    while let Some(a) = it.next() {
        if a == "--" {
            rest.push(a);
            rest.extend(it.by_ref());
            break;
        }
        if a == "--config" {
            file = Some(PathBuf::from(it.next().ok_or(ConfigFileError::NoFile)?));
            continue;
        }
        if let Some(p) = a.to_str().and_then(|s| s.strip_prefix("--config=")) {
            file = Some(PathBuf::from(p));
            continue;
        }
        rest.push(a);
    }
    let mut out: Vec<OsString> = program.into_iter().collect();
    if let Some(f) = file {
        out.extend(config_args(cmd, &f)?);
    }
    out.extend(rest);
    Ok(out)
}

/// Makes this process non-dumpable (`PR_SET_DUMPABLE` 0), as lenderd and lendvm do first
/// thing: no core dump (guest RAM, tokens and keys would be in it), and `/proc/PID/fd`,
/// `mem`, `environ` and `maps` become root's, so another process of the same user (another
/// VM's lendvm, or a guest that escaped into one) cannot open this one's fds (VFIO device
/// fds, backing files, guest memory) through `/proc`. Its own `/proc/self` still works.
pub fn set_not_dumpable() -> std::io::Result<()> {
    // SAFETY: prctl(PR_SET_DUMPABLE) takes integer arguments and touches no memory of ours.
    if unsafe { libc::prctl(libc::PR_SET_DUMPABLE, 0, 0, 0, 0) } != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(())
}

/// The hidden `--generate-assets DIR` of the daemons: writes `DIR/NAME.1` (man page) and the
/// bash, zsh and fish completions (`NAME.bash`, `_NAME`, `NAME.fish`), for the packages.
/// `None` when `argv` does not ask for it.
pub fn generate_assets_requested(argv: &[OsString]) -> Option<PathBuf> {
    match argv {
        [_, flag, dir] if flag == "--generate-assets" => Some(PathBuf::from(dir)),
        _ => None,
    }
}

/// Writes the man page and completions of `cmd` into `dir`.
pub fn generate_assets(cmd: clap::Command, dir: &Path) -> io::Result<()> {
    std::fs::create_dir_all(dir)?;
    let name = cmd.get_name().to_string();
    let mut man = Vec::new();
    clap_mangen::Man::new(cmd.clone()).render(&mut man)?;
    std::fs::write(dir.join(format!("{name}.1")), man)?;
    for (shell, file) in [
        (clap_complete::Shell::Bash, format!("{name}.bash")),
        (clap_complete::Shell::Zsh, format!("_{name}")),
        (clap_complete::Shell::Fish, format!("{name}.fish")),
    ] {
        let mut c = cmd.clone();
        let mut out = Vec::new();
        clap_complete::generate(shell, &mut c, name.clone(), &mut out);
        std::fs::write(dir.join(file), out)?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::{Arg, Command};
    use std::os::unix::fs::PermissionsExt;

    fn cmd() -> Command {
        Command::new("t")
            .arg(Arg::new("node").long("node").required(true))
            .arg(Arg::new("cluster").long("cluster").alias("directory"))
            .arg(Arg::new("devices").long("device").action(ArgAction::Append))
            .arg(Arg::new("metrics").long("metrics"))
            .arg(Arg::new("token").long("token"))
            .arg(Arg::new("flag").long("no-thing").action(ArgAction::SetTrue))
            .arg(Arg::new("config").long("config"))
            .args_override_self(true)
    }

    fn file(text: &str, mode: u32) -> tempfile::NamedTempFile {
        let f = tempfile::NamedTempFile::new().unwrap();
        std::fs::write(f.path(), text).unwrap();
        std::fs::set_permissions(f.path(), std::fs::Permissions::from_mode(mode)).unwrap();
        f
    }

    fn argv(v: &[&str]) -> Vec<OsString> {
        v.iter().map(OsString::from).collect()
    }

    #[test]
    fn a_config_file_is_options_the_command_line_overrides() {
        let f = file(
            "node = \"n1\"\ndevices = [\"a\", \"b\"]\nmetrics = \"127.0.0.1:1\"\nno_thing = true\n\
             directory = \"etcd://127.0.0.1:2379\"\n",
            0o600,
        );
        let p = f.path().to_str().unwrap();
        let args = expand_config(
            &cmd(),
            argv(&["t", "--config", p, "--metrics", "x", "--device", "c"]),
        )
        .unwrap();
        let m = cmd().try_get_matches_from(args).unwrap();
        assert_eq!(m.get_one::<String>("node").unwrap(), "n1");
        assert_eq!(m.get_one::<String>("metrics").unwrap(), "x");
        let d: Vec<&String> = m.get_many("devices").unwrap().collect();
        assert_eq!(d, ["a", "b", "c"]);
        assert!(m.get_flag("flag"));
        assert_eq!(
            m.get_one::<String>("cluster").unwrap(),
            "etcd://127.0.0.1:2379"
        );
    }

    #[test]
    fn unknown_keys_writable_files_and_bad_values_are_refused_by_name() {
        let f = file("node = \"n\"\nmetric = \"x\"\n", 0o600);
        let e = config_args(&cmd(), f.path()).unwrap_err().to_string();
        assert!(e.contains("unknown key `metric`"), "{e}");
        assert!(e.contains("metrics") && e.contains("devices"), "{e}");
        let f = file("node = \"n\"\n", 0o620);
        let e = config_args(&cmd(), f.path()).unwrap_err().to_string();
        assert!(e.contains("writable by group or others (mode 620)"), "{e}");
        let f = file("node = \"n\"\n", 0o602);
        assert!(config_args(&cmd(), f.path()).is_err());
        let f = file("node = [1]\n", 0o600);
        let e = config_args(&cmd(), f.path()).unwrap_err().to_string();
        assert!(e.contains("key `node`"), "{e}");
        let f = file("node = \n", 0o600);
        let e = config_args(&cmd(), f.path()).unwrap_err().to_string();
        assert!(e.contains(&f.path().display().to_string()), "{e}");
        let e = config_args(&cmd(), Path::new("/nonexistent/x.toml")).unwrap_err();
        assert!(e.to_string().contains("/nonexistent/x.toml"), "{e}");
    }

    /// A file with the token must be private and the daemon's (or root's); no config file is
    /// followed through a symbolic link; the checks are made on the opened file.
    #[test]
    fn a_config_file_with_the_token_must_be_private_and_ours_and_no_symlink() {
        let secret = "node = \"n\"\ntoken = \"0123456789abcdef0123456789abcdef\"\n";
        let f = file(secret, 0o640);
        let e = config_args(&cmd(), f.path()).unwrap_err();
        assert!(
            matches!(e, ConfigFileError::SecretReadable { mode: 0o640, .. }),
            "{e:?}"
        );
        assert!(
            e.to_string()
                .contains("readable by group or others (mode 640)"),
            "{e}"
        );
        let f = file(secret, 0o604);
        assert!(matches!(
            config_args(&cmd(), f.path()).unwrap_err(),
            ConfigFileError::SecretReadable { .. }
        ));
        let f = file(secret, 0o600);
        let args = config_args(&cmd(), f.path()).unwrap();
        assert!(args.iter().any(|a| a == "--token"), "{args:?}");
        // Without the token, group and others may read it.
        let f = file("node = \"n\"\n", 0o644);
        config_args(&cmd(), f.path()).unwrap();
        // Another user's file (needs root, to chown; CI runs as root and must check it).
        // SAFETY: geteuid takes no arguments and cannot fail.
        let root = unsafe { libc::geteuid() } == 0;
        assert!(
            root || std::env::var_os("CI").is_none(),
            "CI runs the tests as root: the owner check needs chown"
        );
        if root {
            let f = file(secret, 0o600);
            std::os::unix::fs::chown(f.path(), Some(4242), None).unwrap();
            let e = config_args(&cmd(), f.path()).unwrap_err();
            assert!(
                matches!(
                    e,
                    ConfigFileError::SecretOwner {
                        uid: 4242,
                        euid: 0,
                        ..
                    }
                ),
                "{e:?}"
            );
            assert!(e.to_string().contains("belongs to uid 4242"), "{e}");
        }
        // A symbolic link, to a file that would pass: refused by name.
        let d = tempfile::tempdir().unwrap();
        let f = file(secret, 0o600);
        let link = d.path().join("lenderd.toml");
        std::os::unix::fs::symlink(f.path(), &link).unwrap();
        let e = config_args(&cmd(), &link).unwrap_err();
        assert!(matches!(e, ConfigFileError::Symlink { .. }), "{e:?}");
        assert!(e.to_string().contains("is a symbolic link"), "{e}");
    }

    #[test]
    fn assets_are_a_man_page_and_three_completions() {
        let d = tempfile::tempdir().unwrap();
        generate_assets(cmd(), d.path()).unwrap();
        let man = std::fs::read_to_string(d.path().join("t.1")).unwrap();
        assert!(man.contains(".TH t 1"), "{man}");
        assert!(man.contains("metrics"), "{man}");
        for f in ["t.bash", "_t", "t.fish"] {
            let c = std::fs::read_to_string(d.path().join(f)).unwrap();
            assert!(c.contains("metrics"), "{f}: {c}");
        }
    }
}
