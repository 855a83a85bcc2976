//! Finding a gateway's local stage processes from `/proc` (shared by the
//! benchmarks through `#[path]`; Linux only).

/// Child processes of `ppid` whose command line has `--model-dir` ending
/// in `model`, as `(pid, argv)`.
pub fn stage_children(ppid: u32, model: &str) -> Vec<(u32, Vec<String>)> {
    let mut out = Vec::new();
    let Ok(rd) = std::fs::read_dir("/proc") else {
        return out;
    };
    for e in rd.flatten() {
        let Some(pid) = e.file_name().to_str().and_then(|s| s.parse::<u32>().ok()) else {
            continue;
        };
        let stat = std::fs::read_to_string(format!("/proc/{pid}/stat")).unwrap_or_default();
        // Field 4 (ppid) follows the `(name)` field, which may hold spaces.
        let parent = stat
            .rsplit_once(')')
            .and_then(|(_, rest)| rest.split_whitespace().nth(1))
            .and_then(|p| p.parse::<u32>().ok());
        if parent != Some(ppid) {
            continue;
        }
        let argv: Vec<String> = std::fs::read(format!("/proc/{pid}/cmdline"))
            .unwrap_or_default()
            .split(|b| *b == 0)
            .map(|a| String::from_utf8_lossy(a).into_owned())
            .collect();
        if arg(&argv, "--model-dir").is_some_and(|d| d.trim_end_matches('/').ends_with(model)) {
            out.push((pid, argv));
        }
    }
    out
}

/// The value after `flag` in `argv`.
pub fn arg<'a>(argv: &'a [String], flag: &str) -> Option<&'a String> {
    argv.iter()
        .position(|a| a == flag)
        .and_then(|i| argv.get(i + 1))
}
