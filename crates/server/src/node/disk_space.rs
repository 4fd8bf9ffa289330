//! Free space of the data directory's file system, watched so that a
//! member raises the cluster's NOSPACE alarm before its disk fills.
//!
//! A disk that fills under the log is the failure to avoid: the log then
//! holds what it could not write and stops taking work until there is
//! room (nothing acknowledged is lost, but the member falls behind, and
//! as leader it stalls its group until another is elected). The alarm
//! makes every member refuse the writes that grow the store (puts, txns
//! with a put, lease grants) while deletes and compactions still go
//! through, which keeps the log's growth to what an operator does to make room.
//! The reserve is what is left for that, for the store's flushes and
//! merges, and for the entries in flight when the alarm is raised.

use std::ffi::CString;
use std::os::unix::ffi::OsStrExt;
use std::path::Path;

/// Bytes free for an unprivileged writer on the file system holding
/// `path` (statvfs's `f_bavail` blocks of `f_frsize` bytes).
pub(crate) fn available_bytes(path: &Path) -> std::io::Result<u64> {
    let c_path = CString::new(path.as_os_str().as_bytes())
        .map_err(|_| std::io::Error::other("the path holds a NUL byte"))?;
    // SAFETY: `c_path` is a NUL-terminated string that outlives the call,
    // and `stats` is a plain struct statvfs fills in; it is read only when
    // the call succeeded.
    let mut stats: libc::statvfs = unsafe { std::mem::zeroed() };
    let result = unsafe { libc::statvfs(c_path.as_ptr(), &mut stats) };
    if result != 0 {
        return Err(std::io::Error::last_os_error());
    }
    Ok(stats.f_bavail.saturating_mul(stats.f_frsize))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn the_free_space_of_an_existing_directory_is_read() {
        let dir = std::env::temp_dir();
        assert!(available_bytes(&dir).unwrap() > 0);
        assert!(available_bytes(&dir.join("no-such-directory-here")).is_err());
    }
}
