//! `fuzz_seeds DIR`: writes every target's seed inputs ([`fuzz::seeds`]) to
//! `DIR/<target>/seed-<n>`, where `scripts/fuzz.sh` starts its campaigns.

fn main() {
    let dir = std::env::args_os()
        .nth(1)
        .map(std::path::PathBuf::from)
        .unwrap_or_else(|| {
            eprintln!("usage: fuzz_seeds DIR");
            std::process::exit(2)
        });
    let mut counts = std::collections::BTreeMap::<&str, usize>::new();
    for (target, input) in fuzz::seeds::all() {
        let n = counts.entry(target).or_default();
        let folder = dir.join(target);
        std::fs::create_dir_all(&folder).expect("seed folder");
        std::fs::write(folder.join(format!("seed-{n:02}")), input).expect("seed file");
        *n += 1;
    }
    for (target, n) in counts {
        println!("{target}: {n} seeds");
    }
}
