//! Handing freed heap memory back to the operating system.
//!
//! glibc's allocator keeps pages that its arenas freed (one arena per
//! thread that allocated, up to 8 per core), so a stage whose requests come
//! and go — KV caches, activations, sealed bodies of every size — holds on
//! to its highest use and, through fragmentation, creeps above it (the soak
//! in `benchmark_results/soak.md` measured it). `malloc_trim(0)` returns
//! the free pages of every arena, the middle of the heap included. A stage
//! calls it from its own thread every few seconds; it only takes the
//! arenas' locks, for about a millisecond.
//!
//! Only on glibc: musl (the static container build) returns memory as it
//! frees it, and there this is a no-op.

use std::time::Duration;

/// Starts a thread that returns freed heap memory to the OS every `every`.
pub fn trim_periodically(every: Duration) {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    {
        let spawned = std::thread::Builder::new()
            .name("malloc-trim".into())
            .spawn(move || loop {
                std::thread::sleep(every);
                trim();
            });
        if let Err(e) = spawned {
            tracing::warn!(error = %e, "could not start the malloc-trim thread");
        }
    }
    #[cfg(not(all(target_os = "linux", target_env = "gnu")))]
    let _ = every;
}

/// Returns freed heap memory to the OS now (glibc; a no-op elsewhere).
pub fn trim() {
    #[cfg(all(target_os = "linux", target_env = "gnu"))]
    // SAFETY: malloc_trim takes no pointers and only walks the allocator's
    // own arenas under their locks; any thread may call it at any time.
    unsafe {
        libc::malloc_trim(0);
    }
}
