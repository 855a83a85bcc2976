//! `enclave_stage::memory::trim` hands freed heap pages back to the OS. In a
//! test binary of its own: RSS is a process-wide reading, which other tests
//! allocating on other threads would disturb.

/// RSS after trimming a freed 64 MiB of small blocks is well below RSS
/// while they were held (without the trim it stays where it was).
#[cfg(all(target_os = "linux", target_env = "gnu"))]
#[test]
fn trimming_returns_freed_heap_pages() {
    fn rss_kib() -> u64 {
        let status = std::fs::read_to_string("/proc/self/status").unwrap();
        let line = status.lines().find(|l| l.starts_with("VmRSS:")).unwrap();
        line.split_whitespace().nth(1).unwrap().parse().unwrap()
    }
    // Blocks below the mmap threshold live in the heap, where free() alone
    // keeps them; one block kept at the end pins the heap's top.
    let mut blocks: Vec<Vec<u8>> = (0..4096).map(|i| vec![i as u8; 16 * 1024]).collect();
    let held = rss_kib();
    let last = blocks.pop();
    drop(blocks);
    enclave_stage::memory::trim();
    let trimmed = rss_kib();
    drop(last);
    assert!(
        trimmed + 32 * 1024 < held,
        "RSS {held} KiB while held, {trimmed} KiB after free + trim"
    );
}
