//! The client verbs' files: standard input and output for `-`, files and
//! folders only their owner can read (keys and archives hold secrets and
//! plaintext), and hex arguments.

use anyhow::{anyhow, Context, Result};
use std::io::{Read, Write};
use std::path::Path;

/// Reads a file, or standard input for `-`.
pub fn read_input(path: &Path) -> Result<Vec<u8>> {
    if path.as_os_str() == "-" {
        let mut buf = Vec::new();
        std::io::stdin()
            .read_to_end(&mut buf)
            .context("reading standard input")?;
        return Ok(buf);
    }
    std::fs::read(path).with_context(|| format!("reading {}", path.display()))
}

/// Writes a file, or standard output for `-`.
pub fn write_output(path: &Path, data: &[u8]) -> Result<()> {
    if path.as_os_str() == "-" {
        let mut out = std::io::stdout().lock();
        out.write_all(data)?;
        return Ok(out.flush()?);
    }
    std::fs::write(path, data).with_context(|| format!("writing {}", path.display()))
}

/// Parses a hex argument (`--nonce`); an optional `0x` prefix is allowed.
pub fn parse_hex(what: &str, s: &str) -> Result<Vec<u8>> {
    let s = s.trim();
    hex::decode(s.strip_prefix("0x").unwrap_or(s)).map_err(|e| anyhow!("{what} is not hex: {e}"))
}

/// Writes `data` to `path` with mode 0600 (also when the file existed).
pub fn write_private(path: &Path, data: &[u8]) -> Result<()> {
    use std::os::unix::fs::{OpenOptionsExt, PermissionsExt};
    let mut f = std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(true)
        .mode(0o600)
        .open(path)
        .with_context(|| format!("writing {}", path.display()))?;
    f.set_permissions(std::fs::Permissions::from_mode(0o600))
        .with_context(|| format!("chmod 600 {}", path.display()))?;
    f.write_all(data)
        .with_context(|| format!("writing {}", path.display()))
}

/// Creates `dir` (and missing parents) readable by its owner only (0700),
/// also when it existed: client-side archives hold plaintext.
pub fn create_private_dir(dir: &Path) -> Result<()> {
    use std::os::unix::fs::{DirBuilderExt, PermissionsExt};
    std::fs::DirBuilder::new()
        .recursive(true)
        .mode(0o700)
        .create(dir)
        .with_context(|| format!("creating {}", dir.display()))?;
    std::fs::set_permissions(dir, std::fs::Permissions::from_mode(0o700))
        .with_context(|| format!("chmod 700 {}", dir.display()))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn private_file_mode() {
        use std::os::unix::fs::PermissionsExt;
        let p = std::env::temp_dir().join(format!("gw-cli-key-{}", std::process::id()));
        std::fs::write(&p, b"old").unwrap();
        std::fs::set_permissions(&p, std::fs::Permissions::from_mode(0o644)).unwrap();
        write_private(&p, b"secret").unwrap();
        let mode = std::fs::metadata(&p).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o600);
        assert_eq!(std::fs::read(&p).unwrap(), b"secret");
        std::fs::remove_file(&p).unwrap();
    }

    #[test]
    fn private_dir_mode() {
        use std::os::unix::fs::PermissionsExt;
        let d = std::env::temp_dir().join(format!("gw-cli-dir-{}/a/b", std::process::id()));
        create_private_dir(&d).unwrap();
        let mode = std::fs::metadata(&d).unwrap().permissions().mode() & 0o777;
        assert_eq!(mode, 0o700);
        std::fs::remove_dir_all(d.parent().unwrap().parent().unwrap()).unwrap();
    }
}
