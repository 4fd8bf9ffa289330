//! The test bed a nemesis run builds and tears down: a network namespace
//! per member, joined by veth pairs to a bridge in the run's own
//! namespace (where the clients and the nemesis run), and a size-limited
//! ext4 file system on a loop device for each member's data directory.
//!
//! Every address lives inside namespaces the run created (the host's
//! network is untouched), and every fault is a command run inside a
//! member's namespace or on its file system:
//!
//! | fault | how |
//! | --- | --- |
//! | partition, one-way | `iptables -A OUTPUT -d PEER -j DROP` in the member's namespace |
//! | packet loss | the same rule with `-m statistic --mode random --probability P` |
//! | disk full | `fallocate` of every free byte of the member's file system |
//! | disk stall (fsync that takes seconds) | `fsfreeze -f` on it, `fsfreeze -u` to heal |
//!
//! Pauses and kills are signals to the member's process (see `members`).
//! A command that fails is an error with its words: a fault that cannot be
//! applied stops the run, it is never skipped.

use std::path::{Path, PathBuf};
use std::process::Command;

/// The first three octets of the test network (a /24 inside the run's
/// namespaces only).
const SUBNET: &str = "10.77.0";
/// The bridge's address, from which every client connects.
pub const HUB_ADDRESS: &str = "10.77.0.254";
/// The client port every member listens on, at its own address.
pub const CLIENT_PORT: u16 = 2379;
/// The peer port every member listens on, at its own address.
pub const PEER_PORT: u16 = 2380;
/// The programs a run needs, with the Debian package that has each.
pub const PROGRAMS: &[(&str, &str)] = &[
    ("ip", "iproute2"),
    ("iptables", "iptables"),
    ("mkfs.ext4", "e2fsprogs"),
    ("mount", "mount"),
    ("umount", "mount"),
    ("fallocate", "util-linux"),
    ("fsfreeze", "util-linux"),
    ("df", "coreutils"),
    ("kill", "procps"),
];

/// A command of the test bed that failed.
#[derive(Debug, thiserror::Error)]
#[error("`{command}` failed: {reason}")]
pub struct TestbedError {
    /// The command line.
    pub command: String,
    /// Its exit status and what it wrote to stderr, or why it could not run.
    pub reason: String,
}

/// Runs `program` with `args`; its stdout on success.
pub fn run(program: &str, args: &[&str]) -> Result<String, TestbedError> {
    let command_line = std::iter::once(program)
        .chain(args.iter().copied())
        .collect::<Vec<_>>()
        .join(" ");
    let output = Command::new(program)
        .args(args)
        .output()
        .map_err(|error| TestbedError {
            command: command_line.clone(),
            reason: error.to_string(),
        })?;
    if !output.status.success() {
        return Err(TestbedError {
            command: command_line,
            reason: format!(
                "{}: {}",
                output.status,
                String::from_utf8_lossy(&output.stderr).trim()
            ),
        });
    }
    Ok(String::from_utf8_lossy(&output.stdout).into_owned())
}

/// Whether `program` is on the PATH.
pub fn have_program(program: &str) -> bool {
    std::env::var_os("PATH")
        .is_some_and(|path| std::env::split_paths(&path).any(|dir| dir.join(program).is_file()))
}

/// The namespace the run's clients, bridge and nemesis live in.
pub fn hub_namespace(run_id: &str) -> String {
    format!("fnem{run_id}")
}

/// The namespace of member `id`.
pub fn member_namespace(run_id: &str, id: u64) -> String {
    format!("fnem{run_id}-{id}")
}

/// Member `id`'s address.
pub fn member_address(id: u64) -> String {
    format!("{SUBNET}.{id}")
}

/// The network and disks of one run. Built inside the hub namespace (the
/// process that builds it runs there); [`Testbed::teardown`] undoes what
/// was built, also after a partial build.
pub struct Testbed {
    run_id: String,
    members: u64,
    dir: PathBuf,
    /// Member namespaces created so far.
    namespaces: Vec<String>,
    /// Mount points of member file systems mounted so far.
    mounts: Vec<PathBuf>,
    /// Mount points frozen now (thawed before anything else at teardown:
    /// a frozen file system cannot be unmounted).
    frozen: Vec<PathBuf>,
}

impl Testbed {
    /// Builds the bridge, one namespace per member with its address, and
    /// one file system of `disk_bytes` per member under `dir`.
    pub fn build(
        run_id: &str,
        members: u64,
        dir: &Path,
        disk_bytes: u64,
    ) -> Result<Testbed, TestbedError> {
        let mut testbed = Testbed {
            run_id: run_id.to_string(),
            members,
            dir: dir.to_path_buf(),
            namespaces: Vec::new(),
            mounts: Vec::new(),
            frozen: Vec::new(),
        };
        if let Err(error) = testbed
            .build_network()
            .and_then(|()| testbed.build_disks(disk_bytes))
        {
            testbed.teardown();
            return Err(error);
        }
        Ok(testbed)
    }

    fn build_network(&mut self) -> Result<(), TestbedError> {
        run("ip", &["link", "set", "lo", "up"])?;
        run("ip", &["link", "add", "br0", "type", "bridge"])?;
        run(
            "ip",
            &["addr", "add", &format!("{HUB_ADDRESS}/24"), "dev", "br0"],
        )?;
        run("ip", &["link", "set", "br0", "up"])?;
        for id in 1..=self.members {
            let namespace = member_namespace(&self.run_id, id);
            run("ip", &["netns", "add", &namespace])?;
            self.namespaces.push(namespace.clone());
            let hub_end = format!("m{id}");
            run(
                "ip",
                &[
                    "link", "add", &hub_end, "type", "veth", "peer", "name", "eth0", "netns",
                    &namespace,
                ],
            )?;
            run("ip", &["link", "set", &hub_end, "master", "br0", "up"])?;
            let address = format!("{}/24", member_address(id));
            run(
                "ip",
                &["-n", &namespace, "addr", "add", &address, "dev", "eth0"],
            )?;
            run("ip", &["-n", &namespace, "link", "set", "eth0", "up"])?;
            run("ip", &["-n", &namespace, "link", "set", "lo", "up"])?;
            // Fails here, before any client runs, if iptables cannot work
            // in a namespace on this machine.
            self.iptables(id, &["-F"])?;
        }
        Ok(())
    }

    fn build_disks(&mut self, disk_bytes: u64) -> Result<(), TestbedError> {
        for id in 1..=self.members {
            let image = self.dir.join(format!("member{id}.img"));
            let mount_point = self.mount_point(id);
            let io_error = |error: std::io::Error| TestbedError {
                command: format!("create {}", image.display()),
                reason: error.to_string(),
            };
            std::fs::File::create(&image)
                .and_then(|file| file.set_len(disk_bytes))
                .map_err(io_error)?;
            std::fs::create_dir_all(&mount_point).map_err(io_error)?;
            let image_path = image.to_string_lossy();
            // -m 0: members run as root, and root's reserved blocks would
            // otherwise let them write past "full".
            run("mkfs.ext4", &["-q", "-F", "-m", "0", &image_path])?;
            let mount_path = mount_point.to_string_lossy();
            run("mount", &["-o", "loop", &image_path, &mount_path])?;
            self.mounts.push(mount_point);
        }
        Ok(())
    }

    /// Where member `id`'s file system is mounted.
    fn mount_point(&self, id: u64) -> PathBuf {
        self.dir.join(format!("member{id}"))
    }

    /// Member `id`'s data directory, on its own file system.
    pub fn data_dir(&self, id: u64) -> PathBuf {
        self.mount_point(id).join("data")
    }

    /// The namespace member `id` runs in.
    pub fn namespace(&self, id: u64) -> String {
        member_namespace(&self.run_id, id)
    }

    fn iptables(&self, id: u64, args: &[&str]) -> Result<String, TestbedError> {
        let namespace = self.namespace(id);
        let mut all = vec!["netns", "exec", namespace.as_str(), "iptables", "-w"];
        all.extend_from_slice(args);
        run("ip", &all)
    }

    /// Drops every packet `from` sends to `to` (with `probability` 1.0) or
    /// that share of them, at random.
    pub fn drop_packets(&self, from: u64, to: u64, probability: f64) -> Result<(), TestbedError> {
        let destination = member_address(to);
        let mut args = vec!["-A", "OUTPUT", "-d", destination.as_str()];
        let probability_text = format!("{probability:.3}");
        if probability < 1.0 {
            args.extend_from_slice(&[
                "-m",
                "statistic",
                "--mode",
                "random",
                "--probability",
                probability_text.as_str(),
            ]);
        }
        args.extend_from_slice(&["-j", "DROP"]);
        self.iptables(from, &args).map(drop)
    }

    /// Cuts every member of `side` off from every member not in it, both
    /// ways.
    pub fn partition(&self, side: &[u64]) -> Result<(), TestbedError> {
        for a in side {
            for b in (1..=self.members).filter(|b| !side.contains(b)) {
                self.drop_packets(*a, b, 1.0)?;
                self.drop_packets(b, *a, 1.0)?;
            }
        }
        Ok(())
    }

    /// Removes every packet rule: the network is whole again.
    pub fn heal_network(&self) -> Result<(), TestbedError> {
        for id in 1..=self.members {
            self.iptables(id, &["-F", "OUTPUT"])?;
        }
        Ok(())
    }

    fn filler(&self, id: u64, n: u32) -> PathBuf {
        self.mount_point(id).join(format!("filler-{n}"))
    }

    /// Free bytes on member `id`'s file system.
    fn free_bytes(&self, id: u64) -> Result<u64, TestbedError> {
        let mount = self.mount_point(id);
        let mount_text = mount.to_string_lossy();
        let out = run("df", &["-B1", "--output=avail", &mount_text])?;
        out.lines()
            .filter_map(|line| line.trim().parse::<u64>().ok())
            .next()
            .ok_or_else(|| TestbedError {
                command: format!("df -B1 --output=avail {mount_text}"),
                reason: format!("no number in its output {out:?}"),
            })
    }

    /// Takes every free byte of member `id`'s file system; returns how many
    /// were taken.
    pub fn fill_disk(&self, id: u64) -> Result<u64, TestbedError> {
        let mut taken = 0u64;
        // One large allocation, then smaller ones for what block groups and
        // metadata leave over.
        for n in 0..32 {
            let free = self.free_bytes(id)?;
            if free < 4096 {
                break;
            }
            let path = self.filler(id, n);
            let path_text = path.to_string_lossy();
            let mut length = free;
            while length >= 4096 {
                if run("fallocate", &["-l", &length.to_string(), &path_text]).is_ok() {
                    taken = taken.saturating_add(length);
                    break;
                }
                let _ = std::fs::remove_file(&path);
                length /= 2;
            }
        }
        Ok(taken)
    }

    /// Gives back what [`Testbed::fill_disk`] took.
    pub fn free_disk(&self, id: u64) -> Result<(), TestbedError> {
        for n in 0..32 {
            let path = self.filler(id, n);
            match std::fs::remove_file(&path) {
                Ok(()) => {}
                Err(error) if error.kind() == std::io::ErrorKind::NotFound => {}
                Err(error) => {
                    return Err(TestbedError {
                        command: format!("rm {}", path.display()),
                        reason: error.to_string(),
                    })
                }
            }
        }
        Ok(())
    }

    /// Freezes member `id`'s file system: every write and sync to it
    /// waits until [`Testbed::thaw_disk`].
    pub fn freeze_disk(&mut self, id: u64) -> Result<(), TestbedError> {
        let mount = self.mount_point(id);
        run("fsfreeze", &["-f", &mount.to_string_lossy()])?;
        self.frozen.push(mount);
        Ok(())
    }

    /// Thaws member `id`'s file system.
    pub fn thaw_disk(&mut self, id: u64) -> Result<(), TestbedError> {
        let mount = self.mount_point(id);
        run("fsfreeze", &["-u", &mount.to_string_lossy()])?;
        self.frozen.retain(|frozen| *frozen != mount);
        Ok(())
    }

    /// Undoes everything, as far as it goes; the member processes must
    /// be gone first. Errors are reported on stderr, not returned: a
    /// teardown does all it can.
    pub fn teardown(&mut self) {
        for mount in std::mem::take(&mut self.frozen) {
            if let Err(error) = run("fsfreeze", &["-u", &mount.to_string_lossy()]) {
                eprintln!("ferry nemesis: teardown: {error}");
            }
        }
        for mount in std::mem::take(&mut self.mounts) {
            if let Err(error) = run("umount", &[&mount.to_string_lossy()]) {
                eprintln!("ferry nemesis: teardown: {error}");
            }
        }
        for namespace in std::mem::take(&mut self.namespaces) {
            if let Err(error) = run("ip", &["netns", "del", &namespace]) {
                eprintln!("ferry nemesis: teardown: {error}");
            }
        }
    }
}

impl Drop for Testbed {
    fn drop(&mut self) {
        self.teardown();
    }
}
