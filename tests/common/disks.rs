//! Real disk faults for the real binary (docs/faults.md, "Disk faults"):
//!
//! - [`Shim`]: an `LD_PRELOAD` library, compiled with `cc` at test time, that fails the fence
//!   log's `fdatasync`s, its writes of records, or its writes of zeros with `EIO` while a
//!   trigger file exists. The syscalls of the kernel answer everything else.
//! - [`Ext4`]: an ext4 file system on a loop device, mounted in a mount namespace of its own
//!   (held by a `sleep` the test starts), that the kernel turns read-only on command, as it does
//!   after a disk error (`errors=remount-ro`).
//! - [`Throttle`]: a blkio cgroup (cgroup v1) in which the loop device takes a few writes a
//!   second: a slow device, made by the kernel's block layer.
//!
//! Where `cc`, root, the tools or the cgroup controller are missing they say so and the test
//! skips visibly ([`super::skips`]); with `FG_REQUIRE_SERVICES=1` it fails instead. Whatever
//! they start, make or attach (the holder, the mount, the loop device, the cgroup) is stopped,
//! removed, unmounted and detached on drop, also when the test panics.

use std::path::{Path, PathBuf};
use std::process::{Child, Command, Stdio};

use super::skips;

/// The shim's source. A fault is armed while `$FG_FAULT_DIR/<fault>` exists; the first call it
/// fails creates `$FG_FAULT_DIR/hit-<fault>`, so a test can tell the fault was met. Only calls
/// on a file whose path ends in `.log` (the current log segment) fail.
const SHIM_C: &str = r#"
#define _GNU_SOURCE
#include <dlfcn.h>
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/types.h>
#include <unistd.h>

static int armed(const char *fault) {
    const char *dir = getenv("FG_FAULT_DIR");
    char path[4096];
    if (!dir) return 0;
    snprintf(path, sizeof path, "%s/%s", dir, fault);
    return access(path, F_OK) == 0;
}

static void hit(const char *fault) {
    const char *dir = getenv("FG_FAULT_DIR");
    char path[4096];
    snprintf(path, sizeof path, "%s/hit-%s", dir, fault);
    int fd = open(path, O_WRONLY | O_CREAT, 0644);
    if (fd >= 0) close(fd);
}

static int is_log(int fd) {
    char link[64], path[4096];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, path, sizeof path - 1);
    if (n < 4) return 0;
    path[n] = 0;
    return strcmp(path + n - 4, ".log") == 0;
}

static int zeros(const void *buf, size_t count) {
    const unsigned char *b = buf;
    for (size_t i = 0; i < count; i++)
        if (b[i]) return 0;
    return 1;
}

static int fail(const char *fault) {
    hit(fault);
    errno = EIO;
    return -1;
}

ssize_t pwrite64(int fd, const void *buf, size_t count, off_t offset) {
    static ssize_t (*real)(int, const void *, size_t, off_t);
    if (!real) real = dlsym(RTLD_NEXT, "pwrite64");
    const char *fault = zeros(buf, count) ? "zeros" : "records";
    if (armed(fault) && is_log(fd)) return fail(fault);
    return real(fd, buf, count, offset);
}

ssize_t pwrite(int fd, const void *buf, size_t count, off_t offset) {
    return pwrite64(fd, buf, count, offset);
}

int fdatasync(int fd) {
    static int (*real)(int);
    if (!real) real = dlsym(RTLD_NEXT, "fdatasync");
    if (armed("fdatasync") && is_log(fd)) return fail("fdatasync");
    return real(fd);
}
"#;

/// A fault the shim injects: `EIO` from ...
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Fault {
    /// ... `fdatasync` of the log segment.
    Fdatasync,
    /// ... `pwrite` of records into the log segment.
    Records,
    /// ... `pwrite` of the zeros written ahead of the records (the room for them).
    Zeros,
}

impl Fault {
    fn name(self) -> &'static str {
        match self {
            Fault::Fdatasync => "fdatasync",
            Fault::Records => "records",
            Fault::Zeros => "zeros",
        }
    }
}

/// The shim, built, and the directory of its trigger files.
pub struct Shim {
    dir: tempfile::TempDir,
}

impl Shim {
    /// Compiles the shim with `cc`; `None` (the test skips) where there is no `cc`.
    pub fn build() -> Option<Shim> {
        let dir = tempfile::tempdir().unwrap();
        let source = dir.path().join("shim.c");
        std::fs::write(&source, SHIM_C).unwrap();
        let out = Command::new("cc")
            .args(["-shared", "-fPIC", "-O2", "-o"])
            .arg(dir.path().join("shim.so"))
            .arg(&source)
            .arg("-ldl")
            .output();
        match out {
            Ok(out) if out.status.success() => Some(Shim { dir }),
            Ok(out) => panic!("cc failed on the shim:\n{}", String::from_utf8_lossy(&out.stderr)),
            Err(e) => {
                missing(&format!("no C compiler to build the EIO shim (cc: {e}; apt-get install gcc)"));
                None
            }
        }
    }

    /// Makes `cmd` load the shim, with this shim's triggers.
    pub fn apply(&self, cmd: &mut Command) {
        cmd.env("LD_PRELOAD", self.dir.path().join("shim.so")).env("FG_FAULT_DIR", self.dir.path());
    }

    /// From now on, every call of `fault` on the log fails with `EIO`.
    pub fn arm(&self, fault: Fault) {
        std::fs::write(self.dir.path().join(fault.name()), "").unwrap();
    }

    /// From now on, calls of `fault` reach the kernel again.
    pub fn disarm(&self, fault: Fault) {
        std::fs::remove_file(self.dir.path().join(fault.name())).unwrap();
    }

    /// Whether the shim failed a call of `fault`.
    pub fn hit(&self, fault: Fault) -> bool {
        self.dir.path().join(format!("hit-{}", fault.name())).exists()
    }
}

/// Says the test cannot run here: panics under `FG_REQUIRE_SERVICES=1`, else records the skip.
fn missing(why: &str) {
    assert!(!skips::required(), "{}=1 but {why}", skips::REQUIRE);
    skips::skip(why);
}

/// Runs `cmd`, panicking with its output unless it succeeds.
fn run(what: &str, cmd: &mut Command) -> String {
    let out = cmd.output().unwrap_or_else(|e| panic!("{what}: {e}"));
    assert!(
        out.status.success(),
        "{what}: {}\n{}{}",
        out.status,
        String::from_utf8_lossy(&out.stdout),
        String::from_utf8_lossy(&out.stderr)
    );
    String::from_utf8_lossy(&out.stdout).into_owned()
}

/// An ext4 file system in an image file, loop-mounted over a directory in a mount namespace
/// that a `sleep` holds; only processes started with [`Ext4::command`] see it.
pub struct Ext4 {
    holder: Child,
    image: PathBuf,
    at: PathBuf,
    /// The loop device's name (`loop3`).
    device: String,
    _dir: tempfile::TempDir,
}

impl Ext4 {
    /// Makes a file system of `mib` MiB and mounts it over `at`, with `errors=remount-ro`.
    /// `None` (the test skips) without root or the tools.
    pub fn mount(at: &Path, mib: u64) -> Option<Ext4> {
        if !rustix::process::geteuid().is_root() {
            missing("needs root to attach a loop device and mount ext4 in a mount namespace");
            return None;
        }
        for tool in ["/usr/sbin/mkfs.ext4", "/usr/sbin/e2fsck", "/usr/bin/unshare", "/usr/bin/nsenter"] {
            if !Path::new(tool).exists() {
                missing(&format!("{tool} is missing (apt-get install e2fsprogs util-linux)"));
                return None;
            }
        }
        let dir = tempfile::tempdir().unwrap();
        let image = dir.path().join("ext4.img");
        std::fs::File::create(&image).unwrap().set_len(mib << 20).unwrap();
        run("mkfs.ext4", Command::new("mkfs.ext4").args(["-q", "-F"]).arg(&image));
        let mount = format!(
            "mount -o loop,errors=remount-ro {} {} && echo mounted && exec sleep 100000",
            image.display(),
            at.display()
        );
        let mut holder = Command::new("unshare")
            .args(["-m", "--propagation", "private", "sh", "-c", &mount])
            .stdout(Stdio::piped())
            .stderr(Stdio::piped())
            .spawn()
            .unwrap();
        let mut said = String::new();
        std::io::BufRead::read_line(&mut std::io::BufReader::new(holder.stdout.take().unwrap()), &mut said).unwrap();
        if said.trim() != "mounted" {
            let _ = holder.kill();
            let out = holder.wait_with_output().unwrap();
            panic!("cannot loop-mount ext4: {}", String::from_utf8_lossy(&out.stderr));
        }
        let mut ext4 = Ext4 { holder, image, at: at.to_owned(), device: String::new(), _dir: dir };
        // "/dev/loop3: [2049]:131 (/tmp/.../ext4.img)"
        let attached = run("losetup -j", Command::new("losetup").arg("-j").arg(&ext4.image));
        let device = attached.split(':').next().and_then(|d| d.strip_prefix("/dev/")).unwrap_or("");
        assert!(!device.is_empty(), "no loop device for {}: {attached:?}", ext4.image.display());
        ext4.device = device.to_owned();
        Some(ext4)
    }

    /// `program args…` inside the namespace, where the file system is mounted.
    pub fn command(&self, program: &str) -> Command {
        let mut cmd = Command::new("nsenter");
        cmd.args(["-t", &self.holder.id().to_string(), "-m", "--", program]);
        cmd
    }

    /// `program` inside the namespace, and in the cgroup of `throttle`.
    pub fn throttled_command(&self, throttle: &Throttle, program: &str) -> Command {
        let mut cmd = Command::new("sh");
        let enter = format!(
            "echo $$ > {}/cgroup.procs && exec nsenter -t {} -m -- \"$@\"",
            throttle.dir.display(),
            self.holder.id()
        );
        cmd.args(["-c", &enter, "sh", program]);
        cmd
    }

    /// The loop device's `MAJOR:MINOR`.
    pub fn device_number(&self) -> String {
        let dev = format!("/sys/block/{}/dev", self.device);
        std::fs::read_to_string(&dev).unwrap_or_else(|e| panic!("{dev}: {e}")).trim().to_owned()
    }

    /// `path` (under the mount point) as the test reaches it: through the holder's root.
    pub fn path(&self, path: &Path) -> PathBuf {
        PathBuf::from(format!("/proc/{}/root{}", self.holder.id(), path.display()))
    }

    /// Reports an error to ext4 as a failing disk would: the kernel aborts the journal and
    /// turns the file system read-only (`errors=remount-ro`).
    pub fn fail(&self) {
        let trigger = format!("/sys/fs/ext4/{}/trigger_fs_error", self.device);
        std::fs::write(&trigger, "fencegate test: a disk error").unwrap_or_else(|e| panic!("{trigger}: {e}"));
    }

    /// What an operator does once the disk is sound again: unmount (nothing may use it),
    /// `e2fsck -fy` the image, and mount it read-write again.
    pub fn repair(&mut self) {
        run("umount", self.command("umount").arg(&self.at));
        let out = Command::new("e2fsck").args(["-fy"]).arg(&self.image).output().unwrap();
        // 0: clean; 1: errors corrected.
        assert!(
            matches!(out.status.code(), Some(0 | 1)),
            "e2fsck: {}\n{}",
            out.status,
            String::from_utf8_lossy(&out.stdout)
        );
        let mut mount = self.command("mount");
        mount.args(["-o", "loop,errors=remount-ro"]).arg(&self.image).arg(&self.at);
        run("mount", &mut mount);
        let attached = run("losetup -j", Command::new("losetup").arg("-j").arg(&self.image));
        let device = attached.split(':').next().and_then(|d| d.strip_prefix("/dev/")).unwrap_or("");
        assert!(!device.is_empty(), "no loop device for {}: {attached:?}", self.image.display());
        self.device = device.to_owned();
    }
}

impl Drop for Ext4 {
    /// Unmounts (lazily, should a process still use it), ends the holder, so that the namespace
    /// goes, and detaches the loop device if the kernel has not yet.
    fn drop(&mut self) {
        let _ = self.command("umount").arg("-l").arg(&self.at).output();
        let _ = self.holder.kill();
        let _ = self.holder.wait();
        if let Ok(out) = Command::new("losetup").arg("-j").arg(&self.image).output()
            && !out.stdout.is_empty()
        {
            let _ = Command::new("losetup").args(["-d", &format!("/dev/{}", self.device)]).output();
        }
    }
}

/// Where cgroup v1 mounts its blkio controller.
const BLKIO: &str = "/sys/fs/cgroup/blkio";

/// A blkio cgroup whose processes may write to one block device at most a few times a second
/// (`blkio.throttle.write_iops_device`): their writes and syncs wait in the block layer, as on
/// a slow disk.
pub struct Throttle {
    dir: PathBuf,
}

impl Throttle {
    /// Limits writes to the device `major_minor` (`7:3`) to `iops` a second; `None` (the test
    /// skips) without cgroup v1's blkio controller.
    pub fn new(major_minor: &str, iops: u32) -> Option<Throttle> {
        let root = Path::new(BLKIO);
        if !root.join("blkio.throttle.write_iops_device").exists() {
            missing(&format!(
                "no cgroup v1 blkio controller with throttling at {BLKIO} (cgroup v2's io.max is not tried)"
            ));
            return None;
        }
        let dir = root.join(format!("fencegate-test-{}-{}", std::process::id(), major_minor.replace(':', "-")));
        std::fs::create_dir(&dir).unwrap_or_else(|e| panic!("{}: {e}", dir.display()));
        let throttle = Throttle { dir };
        std::fs::write(throttle.dir.join("blkio.throttle.write_iops_device"), format!("{major_minor} {iops}")).unwrap();
        Some(throttle)
    }
}

impl Drop for Throttle {
    /// Moves whatever still runs in the cgroup to the root one, then removes it.
    fn drop(&mut self) {
        if let Ok(procs) = std::fs::read_to_string(self.dir.join("cgroup.procs")) {
            for pid in procs.lines() {
                let _ = std::fs::write(Path::new(BLKIO).join("cgroup.procs"), pid);
            }
        }
        let _ = std::fs::remove_dir(&self.dir);
    }
}
