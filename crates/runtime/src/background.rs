//! Background threads: work that may wait (a state machine's merges of
//! its files, say) runs at a lower CPU priority than the request path.
//!
//! On a busy machine the cores then go to applies, heartbeats and client
//! requests first, and the background takes what they leave idle; on an
//! idle one it runs at full speed. The work is not skipped, only
//! scheduled behind: the caller still bounds how far it may fall behind.

use std::io;

/// The nice value background threads run at. Under the Linux scheduler a
/// thread at nice 10 gets about a tenth of the CPU time of one at nice 0
/// when both want the same core.
pub const BACKGROUND_NICE: i32 = 10;

/// Lowers the calling thread's CPU priority to [`BACKGROUND_NICE`]
/// (Linux keeps a nice value per thread; elsewhere this does nothing).
/// On an error the thread runs on at the priority it had, which is
/// correct, only less kind to the request path.
pub fn lower_current_thread_priority() -> io::Result<()> {
    #[cfg(target_os = "linux")]
    {
        // SAFETY: gettid and setpriority take and return plain integers;
        // with PRIO_PROCESS and a thread id, Linux sets the nice value of
        // that one thread.
        let rc = unsafe {
            let tid = libc::gettid();
            libc::setpriority(libc::PRIO_PROCESS, tid as libc::id_t, BACKGROUND_NICE)
        };
        if rc != 0 {
            return Err(io::Error::last_os_error());
        }
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    #[cfg(target_os = "linux")]
    fn a_background_thread_runs_at_the_background_nice_value() {
        std::thread::spawn(|| {
            lower_current_thread_priority().unwrap();
            // The thread's own nice value, read back (errno is cleared
            // first: -1 is also a valid nice value).
            // SAFETY: as above; getpriority only reads.
            let nice = unsafe {
                *libc::__errno_location() = 0;
                libc::getpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t)
            };
            assert_eq!(nice, BACKGROUND_NICE);
        })
        .join()
        .unwrap();
        // Other threads keep theirs.
        // SAFETY: as above.
        let nice = unsafe { libc::getpriority(libc::PRIO_PROCESS, libc::gettid() as libc::id_t) };
        assert_ne!(nice, BACKGROUND_NICE);
    }
}
