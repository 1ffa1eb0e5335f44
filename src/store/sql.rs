//! The SQL text the Postgres store sends: values written into statements as literals, and
//! the bounds (`statement_timeout`, `lock_timeout`) put in front of the store's statements.
//!
//! Every statement of the store goes over the *simple* query protocol, values included as
//! literals, so that it works behind a pooler in transaction mode (PgBouncer, RDS Proxy,
//! Supavisor): each message is whole in itself, and no setting outlives its transaction.
//! (sqlx's bound queries prepare a statement first: a named one that stays on the server
//! connection under a name counted per client connection, `sqlx_s_1`, which under
//! transaction pooling meets another client's statement of the same name, or the unnamed one
//! in a message of its own, which the pooler may send to another server connection than the
//! `Bind` that follows.)
//!
//! The store's statements written out in SQL (not calls of its functions, which are cheap to
//! plan) are prepared with SQL `PREPARE` under a name that is a digest of their text
//! ([`prepared_name`]) and run with `EXECUTE` ([`push_execute`]), so that Postgres plans them
//! once per server connection: a server connection that holds the name holds the statement
//! meant, whichever client of a pooler prepared it.
//!
//! The literals are written so that no value can change a statement's meaning, whatever the
//! session's settings: see [`push_text`] and [`push_bytea`].

use std::fmt::Write as _;
use std::time::Duration;

use crate::error::StoreError;

/// A value to write into a statement.
#[derive(Clone, Copy, Debug)]
pub(crate) enum Lit<'a> {
    /// `text`.
    Text(&'a str),
    /// `bytea`.
    Bytes(&'a [u8]),
    /// A `bytea` that may be `NULL`.
    MaybeBytes(Option<&'a [u8]>),
    /// A number (`bigint`, or any integer type the context casts it to).
    Int(i64),
}

impl Lit<'_> {
    fn push(&self, sql: &mut String) -> Result<(), StoreError> {
        match *self {
            Lit::Text(text) => push_text(sql, text)?,
            Lit::Bytes(bytes) | Lit::MaybeBytes(Some(bytes)) => push_bytea(sql, bytes),
            Lit::MaybeBytes(None) => sql.push_str("NULL"),
            Lit::Int(n) => {
                // A negative number is written in parentheses: `$4::float8` must not become
                // `-5::float8`, which casts before it negates (the same value, but keep the
                // reading obvious), and `x -$1` must not become a comment `x --5`.
                if n < 0 {
                    let _ = write!(sql, "({n})");
                } else {
                    let _ = write!(sql, "{n}");
                }
            }
        }
        Ok(())
    }

    /// About how long the literal is.
    pub(crate) fn len_hint(&self) -> usize {
        match *self {
            Lit::Text(t) => t.len() + 3,
            Lit::Bytes(b) | Lit::MaybeBytes(Some(b)) => 2 * b.len() + 20,
            Lit::MaybeBytes(None) => 4,
            Lit::Int(_) => 21,
        }
    }
}

/// `template` with each placeholder `$1`…`$9` replaced by the literal of that argument.
///
/// Only the template is scanned for placeholders; the literals are copied in as they are.
/// The templates are the store's own constants, and a `$` in them is always a placeholder.
pub(crate) fn fill(template: &str, args: &[Lit<'_>]) -> Result<String, StoreError> {
    let extra: usize = args.iter().map(|a| a.len_hint()).sum();
    let mut sql = String::with_capacity(template.len() + extra);
    append(&mut sql, template, args)?;
    Ok(sql)
}

/// [`fill`], appended to `sql`.
pub(crate) fn append(sql: &mut String, template: &str, args: &[Lit<'_>]) -> Result<(), StoreError> {
    let mut rest = template;
    while let Some(at) = rest.find('$') {
        sql.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        let digits = after.bytes().take_while(u8::is_ascii_digit).count();
        let arg = after[..digits]
            .parse::<usize>()
            .ok()
            .and_then(|n| n.checked_sub(1))
            .and_then(|i| args.get(i))
            .ok_or_else(|| {
                StoreError::backend(format!(
                    "statement placeholder out of range in {template:?}"
                ))
            })?;
        arg.push(sql)?;
        rest = &after[digits..];
    }
    sql.push_str(rest);
    Ok(())
}

/// The name under which `body`, with parameters of the types of `args`, is prepared on a
/// server connection: `tower_idempotency_` and a 64-bit FNV-1a digest of the parameter types
/// and the text. The name stands for the text alone, so whichever client of a pooler finds the
/// statement prepared on a shared server connection finds the statement it means. (Names are
/// resolved again when a statement runs under another `search_path` than it was prepared with:
/// Postgres analyses a prepared statement anew whenever the path differs.)
pub(crate) fn prepared_name(body: &str, types: &[&str]) -> String {
    const OFFSET: u64 = 0xcbf2_9ce4_8422_2325;
    const PRIME: u64 = 0x0000_0100_0000_01b3;
    let mut hash = OFFSET;
    let mut add = |part: &str| {
        for &b in part.as_bytes().iter().chain(b"\0") {
            hash ^= u64::from(b);
            hash = hash.wrapping_mul(PRIME);
        }
    };
    for ty in types {
        add(ty);
    }
    add(body);
    format!("tower_idempotency_{hash:016x}")
}

/// Appends `EXECUTE name(args)` for the statement `body` (its placeholders `$1`…`$n` taking
/// `args` in order), preceded, when `prepare` is set, by `PREPARE name(types) AS body`.
///
/// A prepared statement lives on the server connection, not in the message: behind a pooler
/// in transaction mode the next message may reach a server connection where it is not
/// prepared (`26000`), or where a `PREPARE` meets the statement another client prepared
/// (`42P05`); the caller runs the message again the other way. Either way each message is
/// whole in itself, so a pooler carries it safely.
pub(crate) fn push_execute(
    sql: &mut String,
    name: &str,
    body: &str,
    types: &[&str],
    args: &[Lit<'_>],
    prepare: bool,
) -> Result<(), StoreError> {
    if types.len() != args.len() {
        return Err(StoreError::backend(format!(
            "{} values for the {} parameters of {name}",
            args.len(),
            types.len()
        )));
    }
    if prepare {
        let _ = write!(sql, "PREPARE {name}");
        for (i, ty) in types.iter().enumerate() {
            sql.push_str(if i == 0 { "(" } else { ", " });
            sql.push_str(ty);
        }
        sql.push_str(if types.is_empty() { " AS " } else { ") AS " });
        sql.push_str(body);
        sql.push_str("; ");
    }
    let _ = write!(sql, "EXECUTE {name}");
    if !args.is_empty() {
        sql.push('(');
        for (i, arg) in args.iter().enumerate() {
            if i > 0 {
                sql.push_str(", ");
            }
            arg.push(sql)?;
        }
        sql.push(')');
    }
    Ok(())
}

/// `SET LOCAL` of the store's bounds, to put in front of its statements in one message: in
/// a transaction, or in the implicit transaction of a message of several statements, they
/// hold for the statements after them and end with the transaction. A bound of zero leaves
/// the session's own setting. Returns how many statements it wrote.
pub(crate) fn push_bounds(sql: &mut String, statement: Duration, lock: Duration) -> usize {
    let mut written = 0;
    for (name, bound) in [("statement_timeout", statement), ("lock_timeout", lock)] {
        // Postgres takes at most `INT_MAX` milliseconds (about 24 days).
        let ms = bound.as_millis().min(2_147_483_647);
        if ms > 0 {
            let _ = write!(sql, "SET LOCAL {name} = {ms}; ");
            written += 1;
        }
    }
    written
}

/// Appends `bytes` to `sql` as an expression of type `bytea`. Only hex digits are copied into
/// the statement, so no value can change its meaning.
pub(crate) fn push_bytea(sql: &mut String, bytes: &[u8]) {
    sql.reserve(bytes.len() * 2 + 36);
    sql.push_str("pg_catalog.decode('");
    crate::hex::push(sql, bytes);
    sql.push_str("','hex')");
}

/// Appends `text` to `sql` as an expression of type `text` whose meaning does not depend on
/// any session setting.
///
/// Only ASCII ever reaches the statement: ASCII text (keys are ASCII; scopes reach stores as
/// a hex digest) as an escape-string constant `E'…'` with quotes and backslashes doubled,
/// which reads the same whatever `standard_conforming_strings` and `backslash_quote` say, and
/// in every client encoding (all of them are ASCII supersets); any other text as hex bytes
/// converted on the server (`convert_from(…, 'UTF8')`), so a client encoding such as SJIS or
/// BIG5, whose multibyte characters can contain the byte of a backslash or a quote, cannot
/// move the end of the constant. A NUL would end the statement early (the protocol's strings
/// are NUL-terminated); Postgres text cannot hold one anyway, so it is an error here too.
pub(crate) fn push_text(sql: &mut String, text: &str) -> Result<(), StoreError> {
    if text.contains('\0') {
        return Err(StoreError::backend("a value contains a NUL character"));
    }
    if !text.is_ascii() {
        sql.reserve(text.len() * 2 + 64);
        sql.push_str("pg_catalog.convert_from(pg_catalog.decode('");
        crate::hex::push(sql, text.as_bytes());
        sql.push_str("','hex'),'UTF8')");
        return Ok(());
    }
    sql.reserve(text.len() + 3);
    sql.push_str("E'");
    for c in text.chars() {
        match c {
            '\'' => sql.push_str("''"),
            '\\' => sql.push_str("\\\\"),
            c => sql.push(c),
        }
    }
    sql.push('\'');
    Ok(())
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn fill_replaces_each_placeholder_once_and_never_rescans_values() {
        let sql = fill(
            "SELECT $1, $2, $3, $4, $1",
            &[
                Lit::Text("a'$2\\"),
                Lit::Bytes(&[0, 255]),
                Lit::Int(-5),
                Lit::MaybeBytes(None),
            ],
        )
        .unwrap();
        assert_eq!(
            sql,
            "SELECT E'a''$2\\\\', pg_catalog.decode('00ff','hex'), (-5), NULL, E'a''$2\\\\'"
        );
    }

    #[test]
    fn a_placeholder_without_its_argument_is_an_error() {
        assert!(fill("SELECT $2", &[Lit::Int(1)]).is_err());
        assert!(fill("SELECT $0", &[Lit::Int(1)]).is_err());
        assert!(fill("SELECT $x", &[Lit::Int(1)]).is_err());
    }

    #[test]
    fn constants_are_escaped() {
        let mut sql = String::new();
        push_text(&mut sql, r"it's a \ back'slash").unwrap();
        assert_eq!(sql, r"E'it''s a \\ back''slash'");
        let mut sql = String::new();
        push_bytea(&mut sql, &[0x00, 0x7f, 0xff, b'\'']);
        assert_eq!(sql, "pg_catalog.decode('007fff27','hex')");
    }

    #[test]
    fn non_ascii_text_is_sent_as_hex_and_nul_is_refused() {
        let mut sql = String::new();
        push_text(&mut sql, "été'").unwrap();
        assert_eq!(
            sql,
            "pg_catalog.convert_from(pg_catalog.decode('c3a974c3a927','hex'),'UTF8')"
        );
        assert!(sql.is_ascii());
        assert!(push_text(&mut String::new(), "a\0b").is_err());
    }

    #[test]
    fn a_prepared_statement_is_named_by_its_text_and_types_and_prepared_before_it_runs() {
        let args = [Lit::Text("k"), Lit::Int(-1), Lit::MaybeBytes(None)];
        let types = ["text", "bigint", "bytea"];
        let name = prepared_name("SELECT $1, $2, $3", &types);
        assert!(
            name.starts_with("tower_idempotency_") && name.len() == 34,
            "{name}"
        );
        assert_eq!(name, prepared_name("SELECT $1, $2, $3", &types));
        assert_ne!(name, prepared_name("SELECT $1, $2, $3 ", &types));
        let other_types = ["text", "bigint", "text"];
        assert_ne!(name, prepared_name("SELECT $1, $2, $3", &other_types));

        let mut sql = String::new();
        push_execute(&mut sql, "p", "SELECT $1, $2, $3", &types, &args, false).unwrap();
        assert_eq!(sql, "EXECUTE p(E'k', (-1), NULL)");
        let mut sql = String::new();
        push_execute(&mut sql, "p", "SELECT $1, $2, $3", &types, &args, true).unwrap();
        assert_eq!(
            sql,
            "PREPARE p(text, bigint, bytea) AS SELECT $1, $2, $3; EXECUTE p(E'k', (-1), NULL)"
        );
        let mut sql = String::new();
        push_execute(&mut sql, "p", "SELECT 1", &[], &[], true).unwrap();
        assert_eq!(sql, "PREPARE p AS SELECT 1; EXECUTE p");
        assert!(
            push_execute(&mut String::new(), "p", "SELECT $1", &[], &args[..1], false).is_err()
        );
    }

    #[test]
    fn bounds_are_set_locally_and_zero_means_the_sessions_own() {
        let mut sql = String::new();
        push_bounds(&mut sql, Duration::from_secs(5), Duration::ZERO);
        assert_eq!(sql, "SET LOCAL statement_timeout = 5000; ");
    }
}
