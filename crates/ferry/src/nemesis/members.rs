//! The cluster's member processes: `ferry serve`, each started inside its
//! own network namespace (`ip netns exec` replaces itself with the node,
//! so the child's pid is the node's), with its log appended to
//! `member<ID>.log` in the run's directory across restarts.

use std::fs::OpenOptions;
use std::path::{Path, PathBuf};
use std::process::{Child, Command, ExitStatus, Stdio};
use std::time::{Duration, Instant};

use super::testbed::{self, member_address, TestbedError, CLIENT_PORT, PEER_PORT};

/// How long a member has to stop on SIGTERM at the end of a run.
const STOP_TIMEOUT: Duration = Duration::from_secs(20);

/// How every member is started.
#[derive(Clone, Debug)]
pub struct MemberOptions {
    /// The `ferry` binary.
    pub binary: PathBuf,
    /// The length of a Raft tick.
    pub tick_ms: u64,
    /// Free bytes below which a member raises NOSPACE.
    pub disk_reserve_bytes: u64,
}

/// One member.
struct Member {
    id: u64,
    namespace: String,
    data_dir: PathBuf,
    log: PathBuf,
    child: Option<Child>,
    paused: bool,
}

/// A member that exited while it should have been running.
#[derive(Debug, Clone)]
pub struct Crash {
    /// The member.
    pub id: u64,
    /// How it exited.
    pub status: String,
}

/// The members of one run.
pub struct Members {
    options: MemberOptions,
    members: Vec<Member>,
    member_list: Vec<String>,
}

impl Members {
    /// The members of a cluster of `count` on `testbed` (none started yet);
    /// logs go to `dir`.
    pub fn new(
        options: MemberOptions,
        count: u64,
        testbed: &testbed::Testbed,
        dir: &Path,
    ) -> Members {
        let members = (1..=count)
            .map(|id| Member {
                id,
                namespace: testbed.namespace(id),
                data_dir: testbed.data_dir(id),
                log: dir.join(format!("member{id}.log")),
                child: None,
                paused: false,
            })
            .collect();
        let member_list = (1..=count)
            .map(|id| {
                let address = member_address(id);
                format!("{id:x}={address}:{PEER_PORT},http://{address}:{CLIENT_PORT}")
            })
            .collect();
        Members {
            options,
            members,
            member_list,
        }
    }

    /// The ids of every member.
    pub fn ids(&self) -> Vec<u64> {
        self.members.iter().map(|m| m.id).collect()
    }

    fn member(&mut self, id: u64) -> &mut Member {
        let index = usize::try_from(id.saturating_sub(1)).unwrap_or(usize::MAX);
        assert!(index < self.members.len(), "member {id} is not in the run");
        &mut self.members[index]
    }

    /// Starts member `id` (which must not be running).
    pub fn start(&mut self, id: u64) -> Result<(), TestbedError> {
        let options = self.options.clone();
        let member_list = self.member_list.clone();
        let member = self.member(id);
        assert!(member.child.is_none(), "member {id} is already running");
        let failed = |reason: String| TestbedError {
            command: format!("start member {id}"),
            reason,
        };
        let log = OpenOptions::new()
            .create(true)
            .append(true)
            .open(&member.log)
            .map_err(|error| failed(format!("{}: {error}", member.log.display())))?;
        let log_err = log.try_clone().map_err(|error| failed(error.to_string()))?;
        let address = member_address(id);
        let mut command = Command::new("ip");
        command
            .args(["netns", "exec", &member.namespace])
            .arg(&options.binary)
            .args(["serve", "--id", &format!("{id:x}")])
            .arg("--data-dir")
            .arg(&member.data_dir)
            .args(["--listen-client", &format!("{address}:{CLIENT_PORT}")])
            .args(["--listen-peer", &format!("{address}:{PEER_PORT}")])
            .args(["--tick-ms", &options.tick_ms.to_string()])
            .args([
                "--disk-reserve-bytes",
                &options.disk_reserve_bytes.to_string(),
            ]);
        for entry in &member_list {
            command.args(["--member", entry]);
        }
        let child = command
            .stdin(Stdio::null())
            .stdout(log)
            .stderr(log_err)
            .spawn()
            .map_err(|error| failed(error.to_string()))?;
        member.child = Some(child);
        member.paused = false;
        Ok(())
    }

    /// Kills member `id` with SIGKILL and reaps it.
    pub fn kill(&mut self, id: u64) {
        let member = self.member(id);
        if let Some(mut child) = member.child.take() {
            let _ = child.kill();
            let _ = child.wait();
        }
        member.paused = false;
    }

    fn signal(&mut self, id: u64, signal: &str) -> Result<(), TestbedError> {
        let member = self.member(id);
        let Some(child) = &member.child else {
            return Ok(());
        };
        testbed::run("kill", &[signal, &child.id().to_string()]).map(drop)
    }

    /// Stops member `id` with SIGSTOP: it does nothing, answers nothing,
    /// and its connections stay open.
    pub fn pause(&mut self, id: u64) -> Result<(), TestbedError> {
        self.signal(id, "-STOP")?;
        self.member(id).paused = true;
        Ok(())
    }

    /// Continues member `id` after [`Members::pause`].
    pub fn resume(&mut self, id: u64) -> Result<(), TestbedError> {
        self.signal(id, "-CONT")?;
        self.member(id).paused = false;
        Ok(())
    }

    /// Members that exited by themselves since they were started (each is
    /// reaped and reported once).
    pub fn crashed(&mut self) -> Vec<Crash> {
        let mut crashes = Vec::new();
        for member in &mut self.members {
            let Some(child) = &mut member.child else {
                continue;
            };
            if let Ok(Some(status)) = child.try_wait() {
                member.child = None;
                member.paused = false;
                crashes.push(Crash {
                    id: member.id,
                    status: describe_status(status),
                });
            }
        }
        crashes
    }

    /// Continues paused members, then stops every member with SIGTERM and
    /// waits for each; returns those that did not exit cleanly.
    pub fn stop_all(&mut self) -> Vec<Crash> {
        let mut unclean = Vec::new();
        for member in &mut self.members {
            let Some(mut child) = member.child.take() else {
                continue;
            };
            if member.paused {
                let _ = testbed::run("kill", &["-CONT", &child.id().to_string()]);
                member.paused = false;
            }
            let _ = testbed::run("kill", &["-TERM", &child.id().to_string()]);
            let deadline = Instant::now() + STOP_TIMEOUT;
            let status = loop {
                match child.try_wait() {
                    Ok(Some(status)) => break Some(status),
                    Ok(None) if Instant::now() < deadline => {
                        std::thread::sleep(Duration::from_millis(50))
                    }
                    _ => break None,
                }
            };
            match status {
                Some(status) if status.success() => {}
                Some(status) => unclean.push(Crash {
                    id: member.id,
                    status: describe_status(status),
                }),
                None => {
                    let _ = child.kill();
                    let _ = child.wait();
                    unclean.push(Crash {
                        id: member.id,
                        status: format!("still running {} s after SIGTERM", STOP_TIMEOUT.as_secs()),
                    });
                }
            }
        }
        unclean
    }

    /// The last `lines` lines of member `id`'s log.
    pub fn log_tail(&mut self, id: u64, lines: usize) -> String {
        let text = std::fs::read_to_string(&self.member(id).log).unwrap_or_default();
        let tail: Vec<&str> = text.lines().rev().take(lines).collect();
        tail.into_iter().rev().collect::<Vec<_>>().join("\n")
    }
}

impl Drop for Members {
    fn drop(&mut self) {
        for member in &mut self.members {
            if let Some(mut child) = member.child.take() {
                let _ = child.kill();
                let _ = child.wait();
            }
        }
    }
}

fn describe_status(status: ExitStatus) -> String {
    use std::os::unix::process::ExitStatusExt;
    match (status.code(), status.signal()) {
        (Some(code), _) => format!("exit status {code}"),
        (None, Some(signal)) => format!("killed by signal {signal}"),
        (None, None) => status.to_string(),
    }
}
