//! Receipts in a SQL database: an embedded SQLite file, or PostgreSQL
//! shared by several gateways. One table, `receipts`:
//!
//! | column | what |
//! | --- | --- |
//! | `seq` | insertion order (retention drops the lowest) |
//! | `id` | the receipt id (16 bytes, unique) |
//! | `receipt` | the COSE_Sign1 receipt |
//! | `digest_salt` | the salt of its digests, where the gateway knows it |
//! | `created_at` | Unix seconds |
//! | `owner` | the owner id of the API key that made the request (NULL: `[auth]` off); added to older tables when the store opens, their rows given `-`, which no caller is, so no one reads them back |
//!
//! Writes are group-committed: receipts that arrive while a write is in
//! progress go to the database together, one multi-row `INSERT` and one
//! retention `DELETE` per group, and each request waits until its own
//! receipt is written (so another gateway finds it at once). Under load this
//! keeps the store's cost per request small; alone, a request pays for one
//! group of one.
//!
//! Retention: every `min(retention, 64)` receipts written, rows more than
//! `retention` below the newest `seq` are deleted (so up to 63 more may be
//! kept for a moment; PostgreSQL sequences may skip values, so a fleet
//! keeps about `retention`, sometimes a few less).

use super::Stored;
use anyhow::{Context, Result};
use proto::receipt::ReceiptTrailer;
use sqlx::postgres::{PgConnectOptions, PgPool, PgPoolOptions};
use sqlx::sqlite::SqliteSynchronous;
use sqlx::sqlite::{SqliteConnectOptions, SqliteJournalMode, SqlitePool, SqlitePoolOptions};
use sqlx::Row;
use std::path::Path;
use std::str::FromStr;
use std::sync::Arc;
use std::time::{Duration, SystemTime, UNIX_EPOCH};
use tokio::sync::{mpsc, oneshot};

/// How long a query waits for a connection (or SQLite for its lock).
const WAIT: Duration = Duration::from_secs(5);

/// A connection pool to one of the two databases.
enum Pool {
    Sqlite(SqlitePool),
    Postgres(PgPool),
}

/// A SQL receipt store.
pub struct SqlStore {
    pool: Arc<Pool>,
    retention: i64,
    /// Receipts waiting for the writer task, each with who waits for it.
    writes: mpsc::Sender<Pending>,
}

/// A receipt to write, and where to report the outcome.
type Pending = ([u8; 16], Stored, oneshot::Sender<Result<(), String>>);

/// Most receipts in one group write.
const MAX_GROUP: usize = 256;

const SQLITE_SCHEMA: &str = "CREATE TABLE IF NOT EXISTS receipts (
    seq INTEGER PRIMARY KEY,
    id BLOB NOT NULL UNIQUE,
    receipt BLOB NOT NULL,
    digest_salt BLOB,
    created_at INTEGER NOT NULL,
    owner TEXT)";

const POSTGRES_SCHEMA: &str = "CREATE TABLE IF NOT EXISTS receipts (
    seq BIGSERIAL PRIMARY KEY,
    id BYTEA NOT NULL UNIQUE,
    receipt BYTEA NOT NULL,
    digest_salt BYTEA,
    created_at BIGINT NOT NULL,
    owner TEXT)";

/// The statements, in each database's placeholder syntax.
struct Statements {
    schema: &'static str,
    /// Counts an `owner` column (0 in a table made before it existed).
    has_owner: &'static str,
    add_owner: &'static str,
    /// Rows from before the `owner` column: nobody's.
    orphan_rows: &'static str,
    prune: &'static str,
    get: &'static str,
}

const SQLITE: Statements = Statements {
    schema: SQLITE_SCHEMA,
    has_owner: "SELECT COUNT(*) FROM pragma_table_info('receipts') WHERE name = 'owner'",
    add_owner: "ALTER TABLE receipts ADD COLUMN owner TEXT",
    orphan_rows: "UPDATE receipts SET owner = '-' WHERE owner IS NULL",
    prune: "DELETE FROM receipts WHERE seq <= (SELECT MAX(seq) FROM receipts) - ?",
    get: "SELECT receipt, digest_salt, owner FROM receipts WHERE id = ?",
};

const POSTGRES: Statements = Statements {
    schema: POSTGRES_SCHEMA,
    has_owner: "SELECT COUNT(*) FROM information_schema.columns \
                WHERE table_schema = current_schema() AND table_name = 'receipts' \
                AND column_name = 'owner'",
    add_owner: "ALTER TABLE receipts ADD COLUMN IF NOT EXISTS owner TEXT",
    orphan_rows: "UPDATE receipts SET owner = '-' WHERE owner IS NULL",
    prune: "DELETE FROM receipts WHERE seq <= (SELECT MAX(seq) FROM receipts) - $1",
    get: "SELECT receipt, digest_salt, owner FROM receipts WHERE id = $1",
};

/// Runs `body` with `p` bound to the pool and `sql` to its statements:
/// the same code for both databases (their pools are different types).
macro_rules! on_pool {
    ($pool:expr, |$p:ident, $sql:ident| $body:expr) => {
        match $pool {
            Pool::Sqlite($p) => {
                let $sql = &SQLITE;
                $body
            }
            Pool::Postgres($p) => {
                let $sql = &POSTGRES;
                $body
            }
        }
    };
}

fn now() -> i64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map_or(0, |d| d.as_secs() as i64)
}

impl SqlStore {
    /// Opens (creating if missing) the SQLite file at `path`, readable by
    /// its owner only: WAL journal, so that readers never wait for the
    /// writer and several gateway processes can share the file.
    pub async fn sqlite(path: &Path, retention: usize) -> Result<Self> {
        if let Some(dir) = path.parent().filter(|d| !d.as_os_str().is_empty()) {
            std::fs::create_dir_all(dir)
                .with_context(|| format!("receipts.path: creating {}", dir.display()))?;
        }
        owner_only(path).with_context(|| format!("receipts.path: {}", path.display()))?;
        let options = SqliteConnectOptions::new()
            .filename(path)
            .create_if_missing(true)
            .journal_mode(SqliteJournalMode::Wal)
            .synchronous(SqliteSynchronous::Normal)
            .busy_timeout(WAIT);
        let pool = SqlitePoolOptions::new()
            .max_connections(4)
            .acquire_timeout(WAIT)
            .connect_with(options)
            .await
            .with_context(|| format!("receipts.path: opening {}", path.display()))?;
        let pool = Pool::Sqlite(pool);
        create_table(&pool)
            .await
            .with_context(|| format!("receipts.path: creating the table in {}", path.display()))?;
        Ok(Self::start(pool, retention))
    }

    /// Connects to PostgreSQL at `url` (password from `PGPASSWORD`) and
    /// creates the table if it is missing.
    pub async fn postgres(url: &str, retention: usize) -> Result<Self> {
        // Only the host part of the URL goes into messages.
        let shown = url.rsplit_once('@').map_or(url, |(_, h)| h);
        let options = PgConnectOptions::from_str(url)
            .with_context(|| format!("receipts.url: not a PostgreSQL URL ({shown})"))?;
        let pool = PgPoolOptions::new()
            .max_connections(8)
            .acquire_timeout(WAIT)
            .connect_with(options)
            .await
            .with_context(|| format!("receipts.url: connecting to {shown}"))?;
        let pool = Pool::Postgres(pool);
        create_table(&pool)
            .await
            .with_context(|| format!("receipts.url: creating the table at {shown}"))?;
        Ok(Self::start(pool, retention))
    }

    /// The store over `pool`, with its writer task.
    fn start(pool: Pool, retention: usize) -> Self {
        let pool = Arc::new(pool);
        let retention = retention as i64;
        let (writes, rx) = mpsc::channel(4 * MAX_GROUP);
        tokio::spawn(write_groups(pool.clone(), retention, rx));
        Self {
            pool,
            retention,
            writes,
        }
    }

    /// `sqlite` or `postgres`.
    pub fn kind(&self) -> &'static str {
        match *self.pool {
            Pool::Sqlite(_) => "sqlite",
            Pool::Postgres(_) => "postgres",
        }
    }

    /// Keeps a receipt (a second insert of the same id changes nothing):
    /// returns once it is written, in a group with whatever else arrived.
    pub async fn insert(&self, id: [u8; 16], r: Stored) -> Result<()> {
        if self.retention == 0 {
            return Ok(());
        }
        let (done, written) = oneshot::channel();
        self.writes
            .send((id, r, done))
            .await
            .map_err(|_| anyhow::anyhow!("the receipt writer has stopped"))?;
        written
            .await
            .map_err(|_| anyhow::anyhow!("the receipt writer has stopped"))?
            .map_err(anyhow::Error::msg)
    }

    /// A kept receipt.
    pub async fn get(&self, id: &[u8; 16]) -> Result<Option<Stored>> {
        type Row = (Vec<u8>, Option<Vec<u8>>, Option<String>);
        let row: Option<Row> = on_pool!(&*self.pool, |p, sql| {
            sqlx::query(sql.get)
                .bind(&id[..])
                .fetch_optional(p)
                .await
                .context("reading a receipt")?
                .map(|r| (r.get(0), r.get(1), r.get(2)))
        });
        let Some((receipt, salt, owner)) = row else {
            return Ok(None);
        };
        let digest_salt = match salt {
            None => None,
            Some(s) => Some(
                s.try_into()
                    .map_err(|_| anyhow::anyhow!("a stored digest salt has the wrong length"))?,
            ),
        };
        Ok(Some(Stored {
            trailer: ReceiptTrailer {
                receipt,
                digest_salt,
            },
            owner,
        }))
    }
}

/// Creates the table if it is missing, and adds the `owner` column to a
/// table made before it existed. Who made its rows is not known, so they
/// get the owner `-`, which no caller is: no one reads them back (with or
/// without `[auth]`), as no receipt is handed to anyone but its owner.
async fn create_table(pool: &Pool) -> Result<()> {
    on_pool!(pool, |p, sql| {
        sqlx::query(sql.schema).execute(p).await?;
        let has: i64 = sqlx::query(sql.has_owner).fetch_one(p).await?.get(0);
        if has == 0 {
            sqlx::query(sql.add_owner).execute(p).await?;
            sqlx::query(sql.orphan_rows).execute(p).await?;
        }
    });
    Ok(())
}

/// The writer task: takes the receipts that are waiting (up to
/// [`MAX_GROUP`]), writes them in one statement, now and then drops what
/// falls out of retention, and tells each waiting request the outcome.
/// Ends when the store is dropped.
async fn write_groups(pool: Arc<Pool>, retention: i64, mut rx: mpsc::Receiver<Pending>) {
    // The retention delete runs once per this many receipts written, not
    // per group: a lone request then pays for one commit, not two.
    let prune_every = retention.clamp(1, 64) as usize;
    let mut since_prune = 0;
    while let Some(first) = rx.recv().await {
        let mut group = vec![first];
        while group.len() < MAX_GROUP {
            match rx.try_recv() {
                Ok(p) => group.push(p),
                Err(_) => break,
            }
        }
        since_prune += group.len();
        let prune = since_prune >= prune_every;
        if prune {
            since_prune = 0;
        }
        let outcome = write_group(&pool, retention, &group, prune)
            .await
            .map_err(|e| format!("{e:#}"));
        for (_, _, done) in group {
            let _ = done.send(outcome.clone());
        }
    }
}

async fn write_group(pool: &Pool, retention: i64, group: &[Pending], prune: bool) -> Result<()> {
    let created = now();
    on_pool!(pool, |p, sql| {
        let mut insert = sqlx::QueryBuilder::new(
            "INSERT INTO receipts (id, receipt, digest_salt, created_at, owner) ",
        );
        insert.push_values(group, |mut row, (id, r, _)| {
            row.push_bind(id.to_vec())
                .push_bind(r.trailer.receipt.clone())
                .push_bind(r.trailer.digest_salt.map(|s| s.to_vec()))
                .push_bind(created)
                .push_bind(r.owner.clone());
        });
        insert.push(" ON CONFLICT (id) DO NOTHING");
        insert
            .build()
            .execute(p)
            .await
            .context("storing receipts")?;
        if prune {
            sqlx::query(sql.prune)
                .bind(retention)
                .execute(p)
                .await
                .context("dropping old receipts")?;
        }
    });
    Ok(())
}

/// Makes `path` (if missing) readable and writable by its owner only;
/// SQLite gives its `-wal` and `-shm` files the same mode.
fn owner_only(path: &Path) -> std::io::Result<()> {
    use std::os::unix::fs::OpenOptionsExt;
    std::fs::OpenOptions::new()
        .write(true)
        .create(true)
        .truncate(false)
        .mode(0o600)
        .open(path)
        .map(drop)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn kept(b: u8, salt: bool) -> Stored {
        Stored {
            trailer: ReceiptTrailer {
                receipt: vec![b; 40],
                digest_salt: salt.then_some([b; 32]),
            },
            owner: salt.then(|| format!("key-{b}")),
        }
    }

    /// A table made before the `owner` column existed gets it when the
    /// store opens; its old rows have no owner.
    #[tokio::test]
    async fn an_older_table_gains_the_owner_column() {
        let dir = std::env::temp_dir().join(format!("receipts-owner-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(&dir).unwrap();
        let path = dir.join("old.sqlite3");
        {
            let pool = SqlitePoolOptions::new()
                .connect_with(
                    SqliteConnectOptions::new()
                        .filename(&path)
                        .create_if_missing(true),
                )
                .await
                .unwrap();
            sqlx::query(
                "CREATE TABLE receipts (seq INTEGER PRIMARY KEY, id BLOB NOT NULL UNIQUE, \
                 receipt BLOB NOT NULL, digest_salt BLOB, created_at INTEGER NOT NULL)",
            )
            .execute(&pool)
            .await
            .unwrap();
            sqlx::query("INSERT INTO receipts (id, receipt, created_at) VALUES (?, ?, 1)")
                .bind(&[7u8; 16][..])
                .bind(&[1u8, 2][..])
                .execute(&pool)
                .await
                .unwrap();
        }
        let s = SqlStore::sqlite(&path, 10).await.unwrap();
        let old = s.get(&[7; 16]).await.unwrap().unwrap();
        assert_eq!(old.owner.as_deref(), Some("-"));
        assert!(!old.readable_by(None) && !old.readable_by(Some("x")));
        s.insert([8; 16], kept(8, true)).await.unwrap();
        assert_eq!(s.get(&[8; 16]).await.unwrap(), Some(kept(8, true)));
        drop(s);
        // Opening it again finds the column there.
        SqlStore::sqlite(&path, 10).await.unwrap();
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test]
    async fn sqlite_keeps_the_newest_and_survives_reopening() {
        let dir = std::env::temp_dir().join(format!("receipts-test-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let path = dir.join("sub/receipts.sqlite3");
        let s = SqlStore::sqlite(&path, 2).await.unwrap();
        s.insert([1; 16], kept(1, true)).await.unwrap();
        s.insert([2; 16], kept(2, false)).await.unwrap();
        // The same id again changes nothing.
        s.insert([2; 16], kept(9, true)).await.unwrap();
        assert_eq!(s.get(&[1; 16]).await.unwrap(), Some(kept(1, true)));
        assert_eq!(s.get(&[2; 16]).await.unwrap(), Some(kept(2, false)));
        s.insert([3; 16], kept(3, true)).await.unwrap();
        assert_eq!(
            s.get(&[1; 16]).await.unwrap(),
            None,
            "the oldest is dropped"
        );
        drop(s);
        // Another process (or a restarted gateway) sees what was kept.
        let again = SqlStore::sqlite(&path, 2).await.unwrap();
        assert_eq!(again.get(&[3; 16]).await.unwrap(), Some(kept(3, true)));
        assert_eq!(again.get(&[2; 16]).await.unwrap(), Some(kept(2, false)));
        use std::os::unix::fs::PermissionsExt;
        let mode = std::fs::metadata(&path).unwrap().permissions().mode();
        assert_eq!(mode & 0o777, 0o600, "owner only");
        let _ = std::fs::remove_dir_all(&dir);
    }

    #[tokio::test(flavor = "multi_thread", worker_threads = 2)]
    async fn concurrent_receipts_are_written_in_groups_and_all_found() {
        let dir = std::env::temp_dir().join(format!("receipts-group-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        let s = std::sync::Arc::new(
            SqlStore::sqlite(&dir.join("r.sqlite3"), 1000)
                .await
                .unwrap(),
        );
        let mut tasks = Vec::new();
        for b in 0..200u8 {
            let s = s.clone();
            tasks.push(tokio::spawn(async move {
                let mut id = [0u8; 16];
                id[0] = b;
                // The same id twice in one burst: kept once, both succeed.
                s.insert(id, kept(b, b % 2 == 0)).await.unwrap();
                s.insert(id, kept(b, b % 2 == 0)).await.unwrap();
            }));
        }
        for t in tasks {
            t.await.unwrap();
        }
        for b in 0..200u8 {
            let mut id = [0u8; 16];
            id[0] = b;
            assert_eq!(s.get(&id).await.unwrap(), Some(kept(b, b % 2 == 0)));
        }
        let _ = std::fs::remove_dir_all(&dir);
    }
}
