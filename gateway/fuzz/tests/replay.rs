//! Replays every target's seeds and committed corpus (`corpus/<target>/`,
//! grown and minimised by fuzzing campaigns, and holding every input that
//! once crashed a target) through the same functions libFuzzer runs: a
//! fixed crash stays fixed, in the ordinary test suite, without a fuzzer.

use std::path::Path;

#[test]
fn seeds_and_corpora_replay_cleanly() {
    let seeds = fuzz::seeds::all();
    let corpus = Path::new(env!("CARGO_MANIFEST_DIR")).join("corpus");
    for (target, run) in fuzz::targets() {
        let mine: Vec<_> = seeds.iter().filter(|(t, _)| *t == target).collect();
        assert!(!mine.is_empty(), "target {target} has no seeds");
        for (_, input) in mine {
            run(input);
        }
        let dir = corpus.join(target);
        let mut files = 0;
        if let Ok(entries) = std::fs::read_dir(&dir) {
            for e in entries {
                let path = e.expect("corpus entry").path();
                run(&std::fs::read(&path).expect("corpus file"));
                files += 1;
            }
        }
        println!("{target}: {files} corpus inputs replayed");
    }
}

/// The seeds reach past the first check (so the properties are exercised
/// on real data, not only on noise): the recorded gateway side completes a
/// handshake with a stage, and the genuine receipt and the seed bundle verify.
#[test]
fn seeds_reach_past_the_first_check() {
    let seeds = fuzz::seeds::all();
    for (target, _) in fuzz::targets() {
        let n = seeds.iter().filter(|(t, _)| *t == target).count();
        assert!(n >= 2, "{target}: {n} seeds");
    }
    let recorded = seeds
        .iter()
        .find(|(t, input)| *t == "channel" && input[0] == 0)
        .expect("the recorded gateway side");
    assert!(fuzz::channel::handshake(&recorded.1));
    let mut other_side = recorded.1.clone();
    other_side[0] = 1;
    assert!(
        !fuzz::channel::handshake(&other_side),
        "a stage's bytes are not a gateway's"
    );
    assert!(fuzz::receipt::verifies(fuzz::receipt::VALID));
    let bundle = seeds
        .iter()
        .find(|(t, input)| *t == "evidence" && input[0] == 0)
        .expect("the bundle");
    assert!(fuzz::evidence::bundle_verifies(&bundle.1[1..]));
    let mut flipped = fuzz::receipt::VALID.to_vec();
    let last = flipped.len() - 1;
    flipped[last] ^= 1;
    assert!(!fuzz::receipt::verifies(&flipped));
    // The hostile host's first seed (three clients, fresh ids) gets all
    // three answers accepted; sharing one id, at most one is.
    #[cfg(feature = "stage")]
    if let Some(n) = fuzz::host_channel::accepted(&[0, 0, 1, 1, 2, 2]) {
        assert_eq!(n, 3, "host_channel: clean moves");
        let shared = fuzz::host_channel::accepted(&[0, 5, 2, 5]).expect("the rig runs");
        assert!(
            shared <= 1,
            "host_channel: one id, {shared} answers accepted"
        );
    } else {
        println!("host_channel: no model files, not run");
    }
}

/// Every libFuzzer entry point is in [`fuzz::targets`] (so CI replays its
/// corpus), and every listed target has an entry point.
#[cfg(feature = "stage")]
#[test]
fn every_entry_point_is_replayed() {
    let dir = Path::new(env!("CARGO_MANIFEST_DIR")).join("fuzz_targets");
    let mut files: Vec<String> = std::fs::read_dir(dir)
        .expect("fuzz_targets")
        .map(|e| {
            let name = e.expect("entry").file_name().into_string().expect("utf-8");
            name.trim_end_matches(".rs").to_string()
        })
        .collect();
    files.sort();
    let listed: Vec<&str> = fuzz::targets().iter().map(|(t, _)| *t).collect();
    assert_eq!(files, listed);
}
