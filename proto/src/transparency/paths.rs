//! C2SP tlog-tiles paths under a log's prefix: `tile/<L>/<N>[.p/<W>]` for
//! hash tiles and `tile/entries/<N>[.p/<W>]` for entry bundles, N written in
//! three-digit groups (`x001/x234/067`); and the entry-bundle encoding.

use super::TILE_HEIGHT;
use tlog_tiles::Tile;

/// A tile's coordinates: an entry bundle or a hash tile at a level.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct TileName {
    /// `None` for an entry bundle, else the hash tile's level.
    pub level: Option<u8>,
    /// The tile's index at its level.
    pub index: u64,
    /// Its width: 256 when full, else 1 to 255.
    pub width: u32,
}

impl TileName {
    /// The path after the log's prefix, e.g. `tile/0/x001/234.p/7` or
    /// `tile/entries/000`.
    pub fn path(&self) -> String {
        let go = Tile::new(
            TILE_HEIGHT,
            self.level.unwrap_or(0),
            self.index,
            self.width,
            self.level.is_none(),
        )
        .path();
        // tlog_tiles writes the Go sumdb form `tile/8/<L or data>/…`.
        let rest = go
            .split_once('/')
            .and_then(|(_, r)| r.split_once('/'))
            .map(|(_, r)| r)
            .expect("tile paths have a height");
        match self.level {
            None => format!(
                "tile/entries/{}",
                rest.strip_prefix("data/").unwrap_or(rest)
            ),
            Some(_) => format!("tile/{rest}"),
        }
    }

    /// Parses what follows `tile/` (canonical paths only).
    pub fn parse(rest: &str) -> Option<Self> {
        // `Tile::new` panics on a width of 0 or a level of 64 and more:
        // both are refused here first (the path is the host's or a
        // client's input).
        if let Some((_, w)) = rest.rsplit_once(".p/") {
            if !(1..=255).contains(&w.parse::<u32>().ok()?) {
                return None;
            }
        }
        let (level, go_form) = match rest.strip_prefix("entries/") {
            Some(n) => (None, format!("tile/{TILE_HEIGHT}/data/{n}")),
            None => {
                let (l, _) = rest.split_once('/')?;
                // Canonical decimal only: tlog_tiles would take "08".
                if l.is_empty() || (l.len() > 1 && l.starts_with('0')) {
                    return None;
                }
                let l = l.parse::<u8>().ok().filter(|l| *l < 64)?;
                (Some(l), format!("tile/{TILE_HEIGHT}/{rest}"))
            }
        };
        let tile = Tile::from_path(&go_form).ok()?;
        (tile.width() > 0).then_some(Self {
            level,
            index: tile.level_index(),
            width: tile.width(),
        })
    }

    /// The entry bundles of a tree of `size` entries, in order.
    pub fn entry_bundles(size: u64) -> impl Iterator<Item = Self> {
        let full = size >> TILE_HEIGHT;
        let rest = (size & 0xff) as u32;
        (0..full)
            .map(|index| Self {
                level: None,
                index,
                width: 256,
            })
            .chain((rest > 0).then_some(Self {
                level: None,
                index: full,
                width: rest,
            }))
    }
}

/// Splits an entry bundle into its entries (each a big-endian u16 length
/// and its bytes); `None` unless it holds exactly whole entries.
pub fn split_bundle(bundle: &[u8]) -> Option<Vec<Vec<u8>>> {
    let (mut out, mut at) = (Vec::new(), 0usize);
    while at < bundle.len() {
        let n = u16::from_be_bytes([*bundle.get(at)?, *bundle.get(at + 1)?]) as usize;
        out.push(bundle.get(at + 2..at + 2 + n)?.to_vec());
        at += 2 + n;
    }
    Some(out)
}

/// Joins entries into an entry bundle.
pub fn join_bundle<'a>(entries: impl IntoIterator<Item = &'a [u8]>) -> Vec<u8> {
    let mut out = Vec::new();
    for e in entries {
        out.extend_from_slice(&(e.len() as u16).to_be_bytes());
        out.extend_from_slice(e);
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn tile_paths_parse_and_print_as_c2sp_writes_them() {
        let t = |level, index, width| TileName {
            level,
            index,
            width,
        };
        for (path, name) in [
            ("0/000", t(Some(0), 0, 256)),
            ("1/001.p/45", t(Some(1), 1, 45)),
            ("entries/x001/x234/067", t(None, 1_234_067, 256)),
            ("entries/000.p/1", t(None, 0, 1)),
        ] {
            assert_eq!(TileName::parse(path), Some(name), "{path}");
            assert_eq!(name.path(), format!("tile/{path}"));
        }
        for bad in [
            "0/0",             // not three digits
            "00/000",          // level not canonical
            "0/x000/001",      // a leading zero group
            "0/000.p/256",     // a full tile written partial
            "0/000.p/0",       // an empty tile
            "entries/000.p/0", // an empty bundle
            "0/000.p/00",      // the same, written otherwise
            "64/000",          // a level past any tree
            "255/000",
            "entries/000.p/x", // width not a number
            "data/000",        // the Go sumdb name, not C2SP's
            "8/0/000",         // a height in the path
            "",
            "0/",
        ] {
            assert_eq!(TileName::parse(bad), None, "{bad}");
        }
        // No input panics (tlog_tiles asserts on what it is given).
        for l in ["0", "1", "63", "64", "99", "255", "256", "entries"] {
            for n in [
                "000",
                "x001/000",
                "x000/000",
                "999",
                "x999/x999/x999/x999/x999/x999/x999/999",
            ] {
                for w in [
                    "",
                    ".p/0",
                    ".p/1",
                    ".p/255",
                    ".p/256",
                    ".p/99999999999",
                    ".p/-1",
                ] {
                    let _ = TileName::parse(&format!("{l}/{n}{w}"));
                }
            }
        }
        let widths: Vec<u32> = TileName::entry_bundles(513).map(|t| t.width).collect();
        assert_eq!(widths, [256, 256, 1]);
        assert_eq!(TileName::entry_bundles(512).count(), 2);
        assert_eq!(TileName::entry_bundles(0).count(), 0);
    }

    #[test]
    fn bundles_split_only_into_whole_entries() {
        let b = join_bundle([&b"ab"[..], b"", b"c"]);
        assert_eq!(b, [0, 2, b'a', b'b', 0, 0, 0, 1, b'c']);
        assert_eq!(
            split_bundle(&b).unwrap(),
            [b"ab".to_vec(), vec![], b"c".to_vec()]
        );
        assert_eq!(split_bundle(&b[..b.len() - 1]), None);
        assert_eq!(split_bundle(&[0]), None);
    }
}
