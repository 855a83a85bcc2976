//! `LogState`: growth kept, forks refused both ways (at the 256-record tile
//! boundary too), checkpoints of another key refused, the state file
//! reloaded and a damaged one refused. Trees are real RFC 6962 trees
//! (`HashStore`), tiles cut from them as the gateway cuts them, checkpoints
//! signed Ed25519 notes.

use super::*;
use proto::transparency::{sign_checkpoint, verifier_key, HashStore};
use std::sync::atomic::{AtomicUsize, Ordering};

pub(crate) const ORIGIN: &str = "example.com/consistency-test";

pub(crate) fn key(seed: u8) -> ed25519_dalek::SigningKey {
    ed25519_dalek::SigningKey::from_bytes(&[seed; 32])
}

pub(crate) fn vkey() -> String {
    verifier_key(ORIGIN, &key(1).verifying_key())
}

/// A tree of `len` records whose first `shared` are common to every tag and
/// the rest name `tag` (two tags: two logs forked after `shared`).
pub(crate) fn tree(shared: u64, len: u64, tag: &str) -> HashStore {
    let mut s = HashStore::new();
    for i in 0..len {
        let leaf = if i < shared {
            format!("record {i}")
        } else {
            format!("record {i} of {tag}")
        };
        s.append(leaf.as_bytes()).unwrap();
    }
    s
}

/// The checkpoint of `t`'s first `size` records, signed by key `seed`.
pub(crate) fn note(t: &HashStore, size: u64, seed: u8) -> Vec<u8> {
    sign_checkpoint(&key(seed), ORIGIN, size, t.root(size).unwrap()).unwrap()
}

/// Tiles cut from a tree in memory; counts the tiles fetched.
struct MemTiles {
    tree: HashStore,
    fetched: AtomicUsize,
    /// Cut one byte off every tile (a tile of the wrong size).
    short: bool,
}

fn tiles(tree: &HashStore) -> MemTiles {
    MemTiles {
        tree: tree.clone(),
        fetched: AtomicUsize::new(0),
        short: false,
    }
}

impl TileSource for MemTiles {
    async fn fetch(&self, names: &[TileName]) -> Result<Vec<Vec<u8>>> {
        self.fetched.fetch_add(names.len(), Ordering::SeqCst);
        names
            .iter()
            .map(|n| {
                let t = Tile::new(TILE_HEIGHT, n.level.unwrap(), n.index, n.width, false);
                let mut data = t.read_data(&self.tree)?;
                if self.short {
                    data.pop();
                }
                Ok(data)
            })
            .collect()
    }
}

fn observe<T: TileSource>(state: &mut LogState, note: &[u8], tiles: &T) -> Result<Observed> {
    crate::transport::runtime()
        .unwrap()
        .block_on(state.observe(&vkey(), note, tiles))
}

pub(crate) fn temp_path(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("gw-log-state-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    dir.join("log-state.json")
}

#[test]
fn growth_is_proven_and_kept_across_the_tile_boundary() {
    let t = tree(600, 600, "");
    let src = tiles(&t);
    let mut state = LogState::in_memory();
    assert_eq!(
        observe(&mut state, &note(&t, 3, 1), &src).unwrap(),
        Observed::First { size: 3 }
    );
    assert_eq!(
        src.fetched.load(Ordering::SeqCst),
        0,
        "nothing to prove yet"
    );
    let mut at = 3;
    for size in [7, 200, 255, 256, 257, 300, 511, 512, 513, 600] {
        let got = observe(&mut state, &note(&t, size, 1), &src).unwrap();
        assert_eq!(got, Observed::Grew { from: at, to: size });
        assert_eq!(state.latest(ORIGIN).unwrap().size, size);
        assert_eq!(state.latest(ORIGIN).unwrap().root, t.root(size).unwrap());
        at = size;
    }
    let fetched = src.fetched.load(Ordering::SeqCst);
    assert!(fetched > 0);
    // The same checkpoint again: nothing fetched.
    let same = observe(&mut state, &note(&t, 600, 1), &src).unwrap();
    assert_eq!(same, Observed::Same { size: 600 });
    assert_eq!(src.fetched.load(Ordering::SeqCst), fetched);
    // Older checkpoints, proven prefixes of the one kept, which stays.
    for size in [1, 255, 256, 257, 599] {
        let got = observe(&mut state, &note(&t, size, 1), &src).unwrap();
        assert_eq!(got, Observed::Older { size, kept: 600 });
        assert_eq!(state.latest(ORIGIN).unwrap().size, 600);
    }
}

#[test]
fn the_same_size_with_another_root_is_a_split_view() {
    let (a, b) = (tree(4, 5, "a"), tree(4, 5, "b"));
    let mut state = LogState::in_memory();
    observe(&mut state, &note(&a, 5, 1), &tiles(&a)).unwrap();
    let e = observe(&mut state, &note(&b, 5, 1), &tiles(&b))
        .unwrap_err()
        .to_string();
    assert!(e.contains("split view"), "{e}");
    assert!(e.contains("size 5"), "{e}");
    assert!(e.contains(&hex::encode(a.root(5).unwrap().0)), "{e}");
    assert!(e.contains(&hex::encode(b.root(5).unwrap().0)), "{e}");
    assert_eq!(state.latest(ORIGIN).unwrap().root, a.root(5).unwrap());
}

/// Saw `a` at `first`, then `b` at `then`, tiles served from `served`:
/// the refusal's text, and the state still holds `a`'s checkpoint.
fn refused(a: &HashStore, first: u64, b: &HashStore, then: u64, served: &HashStore) -> String {
    let mut state = LogState::in_memory();
    observe(&mut state, &note(a, first, 1), &tiles(a)).unwrap();
    let e =
        observe(&mut state, &note(b, then, 1), &tiles(served)).expect_err("a fork must be refused");
    let kept = state.latest(ORIGIN).unwrap();
    assert_eq!((kept.size, kept.root), (first, a.root(first).unwrap()));
    format!("{e:#}")
}

#[test]
fn a_fork_is_refused_both_ways() {
    // Two logs sharing 3 records, then diverging.
    let (a, b) = (tree(3, 7, "a"), tree(3, 7, "b"));
    // Saw A at 5, then B at 7 (B's tiles prove 5 -> 7 for B only).
    let e = refused(&a, 5, &b, 7, &b);
    assert!(
        e.contains("split view") && e.contains("not a prefix"),
        "{e}"
    );
    // Saw A at 7, then B at 5: tiles at 7 from A (B's 5 is no prefix of
    // it) or from B (they do not hash to A's root at 7).
    let e = refused(&a, 7, &b, 5, &a);
    assert!(
        e.contains("split view") && e.contains("not a prefix"),
        "{e}"
    );
    let e = refused(&a, 7, &b, 5, &b);
    assert!(e.contains("split view"), "{e}");
    // The same at the tile boundary: logs sharing 250 records.
    let (a, b) = (tree(250, 300, "a"), tree(250, 300, "b"));
    for (first, then) in [(255, 256), (256, 257), (251, 300), (300, 256), (257, 251)] {
        for served in [&a, &b] {
            let e = refused(&a, first, &b, then, served);
            assert!(e.contains("split view"), "{first} -> {then}: {e}");
        }
    }
}

#[test]
fn logs_sharing_a_prefix_agree_up_to_it() {
    // Forked after 256 records: their checkpoints up to 256 are one log's.
    let (a, b) = (tree(256, 300, "a"), tree(256, 300, "b"));
    let mut state = LogState::in_memory();
    observe(&mut state, &note(&a, 200, 1), &tiles(&a)).unwrap();
    let got = observe(&mut state, &note(&b, 256, 1), &tiles(&b)).unwrap();
    assert_eq!(got, Observed::Grew { from: 200, to: 256 });
    let got = observe(&mut state, &note(&b, 300, 1), &tiles(&b)).unwrap();
    assert_eq!(got, Observed::Grew { from: 256, to: 300 });
    // From now on A's history is the fork.
    let e = observe(&mut state, &note(&a, 257, 1), &tiles(&a)).unwrap_err();
    assert!(format!("{e:#}").contains("split view"), "{e:#}");
}

#[test]
fn a_checkpoint_signed_by_another_key_is_refused() {
    let t = tree(9, 9, "");
    let mut state = LogState::in_memory();
    let e = observe(&mut state, &note(&t, 5, 2), &tiles(&t)).unwrap_err();
    assert!(format!("{e:#}").contains("checkpoint signature"), "{e:#}");
    assert!(state.latest(ORIGIN).is_none());
    observe(&mut state, &note(&t, 5, 1), &tiles(&t)).unwrap();
    assert!(observe(&mut state, &note(&t, 9, 2), &tiles(&t)).is_err());
    assert_eq!(state.latest(ORIGIN).unwrap().size, 5);
}

#[test]
fn tiles_that_cannot_be_had_refuse_without_blaming_the_log() {
    let t = tree(20, 20, "");
    let mut state = LogState::in_memory();
    observe(&mut state, &note(&t, 5, 1), &NoTiles).unwrap();
    // The same checkpoint needs no tiles.
    observe(&mut state, &note(&t, 5, 1), &NoTiles).unwrap();
    let e = format!(
        "{:#}",
        observe(&mut state, &note(&t, 9, 1), &NoTiles).unwrap_err()
    );
    assert!(e.contains("--log URL") && !e.contains("split view"), "{e}");
    let mut short = tiles(&t);
    short.short = true;
    let e = format!(
        "{:#}",
        observe(&mut state, &note(&t, 9, 1), &short).unwrap_err()
    );
    assert!(e.contains("not 9 hashes of 32"), "{e}");
    assert_eq!(state.latest(ORIGIN).unwrap().size, 5);
}

#[test]
fn the_state_file_survives_a_reload_and_a_damaged_one_is_an_error() {
    let path = temp_path("reload");
    let t = tree(300, 300, "");
    let mut state = LogState::load(&path).unwrap();
    assert!(state.latest(ORIGIN).is_none(), "no file yet: empty");
    assert!(!path.exists());
    observe(&mut state, &note(&t, 100, 1), &tiles(&t)).unwrap();
    let mut again = LogState::load(&path).unwrap();
    assert_eq!(again.latest(ORIGIN), state.latest(ORIGIN));
    // A fork is refused after the reload too, and the file is unchanged.
    let b = tree(50, 300, "b");
    let saved = std::fs::read(&path).unwrap();
    assert!(observe(&mut again, &note(&b, 257, 1), &tiles(&b)).is_err());
    assert_eq!(std::fs::read(&path).unwrap(), saved);
    observe(&mut again, &note(&t, 257, 1), &tiles(&t)).unwrap();
    assert_eq!(
        LogState::load(&path).unwrap().latest(ORIGIN).unwrap().size,
        257
    );
    // No temporary file is left behind.
    let names: Vec<_> = std::fs::read_dir(path.parent().unwrap())
        .unwrap()
        .map(|e| e.unwrap().file_name())
        .collect();
    assert_eq!(names, [path.file_name().unwrap()]);

    let good = std::fs::read_to_string(&path).unwrap();
    let root = hex::encode(t.root(257).unwrap().0);
    let damaged = [
        String::new(),
        good[..good.len() / 2].to_string(),
        "{}".to_string(),
        good.replace("\"version\": 1", "\"version\": 2"),
        good.replace(&root, "00"),
        good.replace("\"size\": 257", "\"size\": \"257\""),
        good.replace("\"checkpoint\"", "\"note\""),
    ];
    for (i, text) in damaged.iter().enumerate() {
        std::fs::write(&path, text).unwrap();
        let e = LogState::load(&path).expect_err("a damaged state file must be refused");
        assert!(
            format!("{e:#}").contains("not a log state file"),
            "{i}: {e:#}"
        );
    }
    // A well-formed file whose root is not its own checkpoint's.
    std::fs::write(&path, good.replace(&root, &hex::encode([7u8; 32]))).unwrap();
    let mut forged = LogState::load(&path).unwrap();
    let e = observe(&mut forged, &note(&t, 257, 1), &tiles(&t)).unwrap_err();
    assert!(
        format!("{e:#}").contains("does not match its own signed checkpoint"),
        "{e:#}"
    );
    // A folder where the file should be: unreadable, an error.
    let dir = path.with_file_name("a-folder");
    std::fs::create_dir(&dir).unwrap();
    assert!(LogState::load(&dir).is_err());
    std::fs::remove_dir_all(path.parent().unwrap()).unwrap();
}

/// Serves `tree`'s hash tiles over HTTP as the gateway lays them out
/// (`/v1/transparency/tile/<L>/<N>[.p/<W>]`); returns the log's URL.
pub(crate) async fn serve_tiles(tree: HashStore) -> String {
    use axum::extract::Path as UrlPath;
    use axum::http::StatusCode;
    let app = axum::Router::new().route(
        "/v1/transparency/tile/{*path}",
        axum::routing::get(move |UrlPath(path): UrlPath<String>| async move {
            let tile = TileName::parse(&path).and_then(|n| {
                let t = Tile::new(TILE_HEIGHT, n.level?, n.index, n.width, false);
                t.read_data(&tree).ok()
            });
            tile.ok_or(StatusCode::NOT_FOUND)
        }),
    );
    let listener = tokio::net::TcpListener::bind("127.0.0.1:0").await.unwrap();
    let addr = listener.local_addr().unwrap();
    tokio::spawn(async move { axum::serve(listener, app).await.unwrap() });
    format!("http://{addr}/v1/transparency")
}

#[test]
fn http_tiles_prove_growth_and_refuse_a_fork() {
    let (a, b) = (tree(300, 300, "a"), tree(100, 300, "b"));
    let rt = crate::transport::runtime().unwrap();
    rt.block_on(async {
        let http = |url: String| HttpTiles {
            client: reqwest::Client::new(),
            url,
        };
        let (url_a, url_b) = (serve_tiles(a.clone()).await, serve_tiles(b.clone()).await);
        let mut state = LogState::in_memory();
        let v = vkey();
        state
            .observe(&v, &note(&a, 120, 1), &http(url_a.clone()))
            .await
            .unwrap();
        let got = state
            .observe(&v, &note(&a, 300, 1), &http(url_a.clone()))
            .await;
        assert_eq!(got.unwrap(), Observed::Grew { from: 120, to: 300 });
        let got = state.observe(&v, &note(&a, 257, 1), &http(url_a)).await;
        assert_eq!(
            got.unwrap(),
            Observed::Older {
                size: 257,
                kept: 300
            }
        );
        let e = state
            .observe(&v, &note(&b, 200, 1), &http(url_b))
            .await
            .unwrap_err();
        assert!(format!("{e:#}").contains("split view"), "{e:#}");
        // A log that serves no tiles: the proof cannot be made, refused.
        let none = http("http://127.0.0.1:9/v1/transparency".into());
        assert!(state.observe(&v, &note(&a, 299, 1), &none).await.is_err());
    });
}

#[test]
fn a_bare_root_is_checked_remembered_and_required_of_later_checkpoints() {
    // Two branches of one log, shared for 280 records.
    let (tx, ty) = (tree(280, 300, "x"), tree(280, 300, "y"));
    let (sx, sy) = (tiles(&tx), tiles(&ty));
    let path = temp_path("ahead");
    let mut state = LogState::load(&path).unwrap();
    let rt = crate::transport::runtime().unwrap();
    let root = |state: &mut LogState, t: &HashStore, src: &MemTiles, size| {
        rt.block_on(state.check_root(&vkey(), size, t.root(size).unwrap(), src))
    };
    let err = root(&mut state, &tx, &sx, 100).unwrap_err();
    assert!(format!("{err:#}").contains("no checkpoint"), "{err:#}");
    observe(&mut state, &note(&tx, 270, 1), &sx).unwrap();
    for size in [1, 255, 256, 270] {
        let seen = root(&mut state, &tx, &sx, size).unwrap();
        assert_eq!(seen, RootSeen::Covered { size, kept: 270 });
    }
    // A larger tree, proven from that tree's tiles, is remembered (not kept).
    let seen = root(&mut state, &tx, &sx, 290).unwrap();
    assert_eq!(
        seen,
        RootSeen::Ahead {
            size: 290,
            kept: 270
        }
    );
    let kept = state.latest(ORIGIN).unwrap();
    assert_eq!(
        (kept.size, kept.ahead),
        (270, Some((290, tx.root(290).unwrap())))
    );
    // A smaller one of the same history passes and does not replace it.
    assert_eq!(
        root(&mut state, &tx, &sx, 285).unwrap(),
        RootSeen::Ahead {
            size: 285,
            kept: 270
        }
    );
    assert_eq!(state.latest(ORIGIN).unwrap().ahead.unwrap().0, 290);
    // The other branch: a split view against the remembered tree, though
    // it extends the kept checkpoint.
    let err = root(&mut state, &ty, &sy, 295).unwrap_err();
    assert!(format!("{err:#}").contains("split view"), "{err:#}");
    // Remembered across a reload.
    let mut state = LogState::load(&path).unwrap();
    assert_eq!(state.latest(ORIGIN).unwrap().ahead.unwrap().0, 290);
    // The next checkpoint must include it: the other branch is refused...
    let err = observe(&mut state, &note(&ty, 300, 1), &sy).unwrap_err();
    assert!(format!("{err:#}").contains("split view"), "{err:#}");
    assert_eq!(state.latest(ORIGIN).unwrap().size, 270);
    // ...one below it must be its prefix, and one that covers it forgets it.
    observe(&mut state, &note(&tx, 280, 1), &sx).unwrap();
    assert_eq!(state.latest(ORIGIN).unwrap().ahead.unwrap().0, 290);
    observe(&mut state, &note(&tx, 300, 1), &sx).unwrap();
    assert_eq!(state.latest(ORIGIN).unwrap().ahead, None);
}

#[test]
fn a_step_names_the_tiles_it_lacks_then_finishes_with_them() {
    use super::sans_io::{step, Step, TileCache};
    let t = tree(600, 600, "");
    let mut state = LogState::in_memory();
    let mem = tiles(&t);
    observe(&mut state, &note(&t, 5, 1), &mem).unwrap();
    let grown = note(&t, 600, 1);
    let mut have = std::collections::HashMap::new();
    let mut rounds = 0;
    let seen = loop {
        rounds += 1;
        assert!(rounds <= super::sans_io::MAX_STEPS, "too many rounds");
        let cache = TileCache::new(have.clone());
        match step(&cache, state.observe(&vkey(), &grown, &cache)).unwrap() {
            Step::Done(seen) => break seen,
            Step::Need(paths) => {
                assert!(!paths.is_empty());
                for path in paths {
                    let name =
                        TileName::parse(path.strip_prefix("tile/").unwrap()).expect("a tile path");
                    let t = Tile::new(
                        TILE_HEIGHT,
                        name.level.unwrap(),
                        name.index,
                        name.width,
                        false,
                    );
                    have.insert(path, t.read_data(&mem.tree).unwrap());
                }
            }
        }
    };
    assert_eq!(seen, Observed::Grew { from: 5, to: 600 });
    assert!(rounds >= 2, "the first step had no tiles");
    // A step with every tile altered: a split view, not a request for more.
    let mut fresh = LogState::in_memory();
    observe(&mut fresh, &note(&t, 5, 1), &mem).unwrap();
    let mut bad = have.clone();
    for v in bad.values_mut() {
        v.iter_mut().for_each(|b| *b ^= 1);
    }
    let cache = TileCache::new(bad);
    let err = step(&cache, fresh.observe(&vkey(), &grown, &cache)).unwrap_err();
    assert!(err.to_string().contains("split view"), "{err:#}");
    assert_eq!(fresh.latest(ORIGIN).unwrap().size, 5);
}
