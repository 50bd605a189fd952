//! Child processes a test starts, such as `ferry run`.

use std::os::unix::process::CommandExt;
use std::process::Command;

/// Makes the child get SIGKILL when the thread that starts it ends. A test
/// killed outright (a timeout, ^C, SIGKILL) never runs the `Drop` that
/// would stop its child; without this, the child runs on, orphaned, holding
/// its database, queues and ports.
///
/// The signal follows the starting thread, not the process: start the child
/// from the test's own thread (a `#[tokio::test]` body on the current-thread
/// runtime), not from a task that may run on a worker thread which ends
/// first. It does not survive a change of user, so it is no use for a child
/// that drops privileges.
pub fn dies_with_test(command: &mut Command) -> &mut Command {
    // SAFETY: the closure runs in the child between fork and exec and only
    // calls prctl(2), which is async-signal-safe.
    unsafe {
        command.pre_exec(|| {
            if libc::prctl(libc::PR_SET_PDEATHSIG, libc::SIGKILL) == 0 {
                Ok(())
            } else {
                Err(std::io::Error::last_os_error())
            }
        })
    }
}
