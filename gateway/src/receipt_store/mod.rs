//! Where receipts live for `GET /v1/receipts/{id}` ([`ReceiptStore`]), and
//! the `[receipts]` configuration that picks it:
//!
//! - `sqlite` (the default): an embedded SQLite file ([`sql`]), so receipts
//!   outlive a gateway restart and every gateway on one machine can share
//!   them;
//! - `postgres`: a PostgreSQL database shared by a fleet of gateways behind
//!   one Service, so that any of them answers for a receipt another issued;
//! - `memory`: this process only ([`memory`]), lost on restart.
//!
//! Each keeps the newest `server.receipt_retention` receipts. A receipt is
//! kept with the salt of its digests where the gateway knows it (requests it
//! saw in plaintext); for requests sealed to the enclave only the client has
//! the salt. With it is kept the owner id of the API key that made the
//! request (when `[auth]` is on), which decides who may read it back
//! ([`Stored::readable_by`]). Nothing else of a request is stored.

use anyhow::{bail, Result};
use proto::receipt::ReceiptTrailer;
use serde::{Deserialize, Serialize};
use std::path::PathBuf;

pub mod memory;
pub mod sql;

/// Which database holds the receipts.
#[derive(Clone, Copy, Debug, Default, Deserialize, Serialize, PartialEq, Eq)]
#[serde(rename_all = "lowercase")]
pub enum StoreKind {
    /// An embedded SQLite file (one machine).
    #[default]
    Sqlite,
    /// A PostgreSQL server (a fleet of gateways).
    Postgres,
    /// This process's memory only.
    Memory,
}

/// `[receipts]`: where receipts are kept (how many: `server.receipt_retention`).
#[derive(Clone, Debug, Deserialize, Serialize)]
#[serde(deny_unknown_fields)]
pub struct ReceiptsConfig {
    /// `sqlite` (default), `postgres` or `memory`.
    #[serde(default)]
    pub store: StoreKind,
    /// The SQLite file (`store = "sqlite"`); made, with its folder, if missing.
    #[serde(default = "default_sqlite_path")]
    pub path: PathBuf,
    /// The PostgreSQL connection URL (`store = "postgres"`), e.g.
    /// `postgres://gateway@db:5432/receipts?sslmode=require`. Leave the
    /// password out: it is read from `PGPASSWORD`.
    #[serde(default)]
    pub url: Option<String>,
}

fn default_sqlite_path() -> PathBuf {
    PathBuf::from("data/receipts.sqlite3")
}

impl Default for ReceiptsConfig {
    fn default() -> Self {
        Self {
            store: StoreKind::default(),
            path: default_sqlite_path(),
            url: None,
        }
    }
}

impl ReceiptsConfig {
    /// Refuses what cannot work: a Postgres store without a URL, or a URL
    /// that carries a password (it would sit in the file and in
    /// `gateway check-config`'s output).
    /// `key` names a key in errors (with the environment variable that set
    /// it, if one did).
    pub fn check(&self, key: &dyn Fn(&str) -> String) -> Result<()> {
        if self.store == StoreKind::Postgres {
            let Some(url) = &self.url else {
                bail!(
                    "{}: store = \"postgres\" needs a connection URL",
                    key("receipts.url")
                );
            };
            if url_has_password(url) {
                bail!(
                    "{}: put the database password in PGPASSWORD, not in the URL",
                    key("receipts.url")
                );
            }
        }
        Ok(())
    }
}

/// Whether a PostgreSQL URL names a password: in its user info
/// (`postgres://user:password@host/...`) or as a `password` query
/// parameter (`?password=...`, which sqlx also reads).
fn url_has_password(url: &str) -> bool {
    let rest = url.split_once("://").map_or(url, |(_, r)| r);
    let authority = rest.split(['/', '?']).next().unwrap_or("");
    let in_userinfo = authority
        .rsplit_once('@')
        .is_some_and(|(userinfo, _)| userinfo.contains(':'));
    let in_query = rest.split_once('?').is_some_and(|(_, q)| {
        q.split('&').any(|kv| {
            let key = kv.split('=').next().unwrap_or("");
            key.eq_ignore_ascii_case("password")
        })
    });
    in_userinfo || in_query
}

/// A kept receipt and whose it is.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Stored {
    /// The receipt, and the salt of its digests where the gateway knew it.
    pub trailer: ReceiptTrailer,
    /// The owner id of the API key that made the request
    /// (`auth::owner_id`); `None` when `[auth]` was off.
    pub owner: Option<String>,
}

impl Stored {
    /// Whether `caller` may read it back (and the salt of its digests,
    /// where the gateway holds it): with `[auth]` on (`caller` is the key's
    /// owner id), only the key that made the request, so no other tenant gets
    /// its salt; with `[auth]` off (`None`) the gateway cannot tell clients
    /// apart, and a receipt made with `[auth]` off is readable by anyone
    /// (one tenant: a plain streaming client gets its salt only here). A
    /// receipt made with `[auth]` on is never readable with it off.
    pub fn readable_by(&self, caller: Option<&str>) -> bool {
        self.owner.as_deref() == caller
    }
}

/// The receipt store the API reads and writes.
pub enum ReceiptStore {
    /// This process only.
    Memory(memory::MemoryStore),
    /// SQLite or PostgreSQL.
    Sql(sql::SqlStore),
}

impl ReceiptStore {
    /// Opens (and for SQL stores, creates the table of) the configured store,
    /// keeping at most `retention` receipts (0 keeps none).
    pub async fn open(cfg: &ReceiptsConfig, retention: usize) -> Result<Self> {
        cfg.check(&|k| k.to_string())?;
        Ok(match cfg.store {
            StoreKind::Memory => Self::Memory(memory::MemoryStore::new(retention)),
            StoreKind::Sqlite => Self::Sql(sql::SqlStore::sqlite(&cfg.path, retention).await?),
            StoreKind::Postgres => {
                let url = cfg.url.as_deref().unwrap_or_default();
                Self::Sql(sql::SqlStore::postgres(url, retention).await?)
            }
        })
    }

    /// A store in this process's memory (tests, benchmarks).
    pub fn in_memory(retention: usize) -> Self {
        Self::Memory(memory::MemoryStore::new(retention))
    }

    /// Keeps a receipt (and the salt of its digests, if known, and its owner).
    pub async fn insert(&self, id: [u8; 16], receipt: Stored) -> Result<()> {
        match self {
            Self::Memory(m) => {
                m.insert(id, receipt);
                Ok(())
            }
            Self::Sql(s) => s.insert(id, receipt).await,
        }
    }

    /// A kept receipt; `Err` when the store cannot be read.
    pub async fn get(&self, id: &[u8; 16]) -> Result<Option<Stored>> {
        match self {
            Self::Memory(m) => Ok(m.get(id)),
            Self::Sql(s) => s.get(id).await,
        }
    }

    /// The store's kind, for logs.
    pub fn kind(&self) -> &'static str {
        match self {
            Self::Memory(_) => "memory",
            Self::Sql(s) => s.kind(),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn who_may_read_a_receipt() {
        let stored = |owner: Option<&str>| Stored {
            trailer: ReceiptTrailer {
                receipt: vec![1],
                digest_salt: Some([2; 32]),
            },
            owner: owner.map(str::to_string),
        };
        let a = stored(Some("team-a"));
        assert!(a.readable_by(Some("team-a")));
        assert!(!a.readable_by(Some("team-b")));
        // Made with [auth] on: not readable once it is off.
        assert!(!a.readable_by(None));
        let anonymous = stored(None);
        assert!(anonymous.readable_by(None));
        // Made with [auth] off: no key owns it.
        assert!(!anonymous.readable_by(Some("team-a")));
    }

    #[test]
    fn passwords_stay_out_of_the_url() {
        assert!(url_has_password("postgres://gw:secret@db/receipts"));
        assert!(url_has_password(
            "postgresql://gw:s%40c@db:5432/r?sslmode=require"
        ));
        assert!(!url_has_password("postgres://gw@db:5432/receipts"));
        assert!(!url_has_password("postgres://db/receipts?user=gw"));
        // Issue 29, finding 7: sqlx also takes it as a query parameter.
        assert!(url_has_password(
            "postgres://gw@db/receipts?password=secret"
        ));
        assert!(url_has_password(
            "postgres://db/receipts?sslmode=require&Password=secret"
        ));
        let cfg = |url: &str| ReceiptsConfig {
            store: StoreKind::Postgres,
            path: default_sqlite_path(),
            url: Some(url.into()),
        };
        assert!(cfg("postgres://gw:secret@db/r")
            .check(&|k| k.to_string())
            .is_err());
        assert!(cfg("postgres://gw@db/r").check(&|k| k.to_string()).is_ok());
        let none = ReceiptsConfig {
            url: None,
            ..cfg("")
        };
        assert!(none
            .check(&|k| k.to_string())
            .unwrap_err()
            .to_string()
            .contains("needs a connection URL"));
    }
}
