//! `GATEWAY_SECTION__KEY=value` environment overrides, applied to the TOML
//! tree before it is parsed.

use super::{ENV_PREFIX, ENV_SEPARATOR};
use anyhow::{anyhow, bail, Result};
use std::collections::BTreeMap;

/// `path` as errors show it: `VARIABLE (path)` when an environment variable
/// set it (or a key inside it, or the table that holds it), else `path`.
pub(super) fn key_name(overrides: &BTreeMap<String, String>, path: &str) -> String {
    let hit = overrides.get(path).or_else(|| {
        overrides.iter().find_map(|(p, var)| {
            let inside = |outer: &str, inner: &str| {
                inner
                    .strip_prefix(outer)
                    .is_some_and(|r| r.starts_with(['.', '[']))
            };
            (inside(p, path) || inside(path, p)).then_some(var)
        })
    });
    match hit {
        Some(var) => format!("{var} ({path})"),
        None => path.to_string(),
    }
}

/// Applies every `GATEWAY_A__B[__C…]` variable to `table`; returns the key
/// paths it set (in error-message form, `a.b[1].c`) with their variables.
/// Variables without `__` after the prefix (such as `GATEWAY_API_KEYS`) are
/// not overrides.
pub(super) fn apply_env_overrides(
    table: &mut toml::Table,
    env: impl IntoIterator<Item = (String, std::ffi::OsString)>,
) -> Result<BTreeMap<String, String>> {
    let mut vars: Vec<(String, std::ffi::OsString)> = env
        .into_iter()
        .filter(|(k, _)| {
            k.strip_prefix(ENV_PREFIX)
                .is_some_and(|r| r.contains(ENV_SEPARATOR))
        })
        .collect();
    // Deterministic order: `…__STAGES__2` after `…__STAGES__1`.
    vars.sort();
    let mut set = BTreeMap::new();
    for (var, value) in vars {
        let value = value
            .into_string()
            .map_err(|_| anyhow!("{var}: the value is not UTF-8"))?;
        let segments: Vec<String> = var[ENV_PREFIX.len()..]
            .split(ENV_SEPARATOR)
            .map(str::to_ascii_lowercase)
            .collect();
        if segments.iter().any(String::is_empty) {
            bail!("{var}: empty key level (levels are separated by exactly `{ENV_SEPARATOR}`)");
        }
        let path =
            set_path(table, &segments, env_value(&value)).map_err(|why| anyhow!("{var}: {why}"))?;
        set.insert(path, var);
    }
    Ok(set)
}

/// An override's value: a TOML value when it parses as exactly one, else the
/// text as a string.
pub(super) fn env_value(text: &str) -> toml::Value {
    match toml::from_str::<toml::Table>(&format!("v = {text}")) {
        Ok(mut t) if t.len() == 1 => t.remove("v").expect("one key"),
        _ => toml::Value::String(text.to_string()),
    }
}

/// Sets `segments` (table keys, or array indices for arrays) to `value`,
/// creating tables on the way; returns the path in error-message form.
pub(super) fn set_path(
    table: &mut toml::Table,
    segments: &[String],
    value: toml::Value,
) -> Result<String, String> {
    let mut path = segments[0].clone();
    let mut cur = table
        .entry(segments[0].clone())
        .or_insert_with(|| toml::Value::Table(toml::Table::new()));
    for seg in &segments[1..] {
        cur = match cur {
            toml::Value::Table(t) => {
                path = format!("{path}.{seg}");
                t.entry(seg.clone())
                    .or_insert_with(|| toml::Value::Table(toml::Table::new()))
            }
            toml::Value::Array(a) => {
                let i: usize = seg
                    .parse()
                    .map_err(|_| format!("{path} is an array: expected an index, got {seg:?}"))?;
                if i > a.len() {
                    return Err(format!(
                        "{path}[{i}]: index out of range ({} elements; the next one is {})",
                        a.len(),
                        a.len()
                    ));
                }
                if i == a.len() {
                    a.push(toml::Value::Table(toml::Table::new()));
                }
                path = format!("{path}[{i}]");
                &mut a[i]
            }
            _ => {
                return Err(format!(
                    "{path} is a value, not a table: cannot set {seg:?} in it"
                ))
            }
        };
    }
    *cur = value;
    Ok(path)
}
