//! The canonical form written: members sorted by UTF-16 code units, the fewest escapes, and
//! numbers in ECMAScript's layout with their exact decimal value.

use std::cmp::Ordering;

use super::*;

/// Appends the canonical form of `value` to `out`. `None` for a number whose exponent does
/// not fit in 64 bits.
pub(crate) fn write(value: &Value<'_>, out: &mut Vec<u8>) -> Option<()> {
    match value {
        Value::Null => out.extend_from_slice(b"null"),
        Value::Bool(true) => out.extend_from_slice(b"true"),
        Value::Bool(false) => out.extend_from_slice(b"false"),
        Value::Number(text) => write_number(text, out)?,
        Value::String(s) => write_string(s, out),
        Value::Array(items) => {
            out.push(b'[');
            for (i, item) in items.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write(item, out)?;
            }
            out.push(b']');
        }
        Value::Object(members) => {
            out.push(b'{');
            for (i, (name, item)) in members.iter().enumerate() {
                if i > 0 {
                    out.push(b',');
                }
                write_string(name, out);
                out.push(b':');
                write(item, out)?;
            }
            out.push(b'}');
        }
    }
    Some(())
}

/// Orders two strings by their UTF-16 code units, as RFC 8785 sorts member names.
pub(super) fn utf16_cmp(a: &str, b: &str) -> Ordering {
    // UTF-8 byte order is code point order, which differs from UTF-16 order only where a
    // character above U+FFFF meets one in U+E000..=U+FFFF: compare bytes unless both have
    // such characters somewhere (a byte 0xEE/0xEF lead, and a 4-byte lead 0xF0..).
    let tricky = |s: &str| s.bytes().any(|b| b >= 0xee);
    if tricky(a) && tricky(b) {
        a.encode_utf16().cmp(b.encode_utf16())
    } else {
        a.as_bytes().cmp(b.as_bytes())
    }
}

/// Writes `s` as a JSON string with RFC 8785's escapes.
pub(super) fn write_string(s: &str, out: &mut Vec<u8>) {
    out.push(b'"');
    let bytes = s.as_bytes();
    let mut run = 0;
    for (i, &b) in bytes.iter().enumerate() {
        let short = match b {
            b'"' => b'"',
            b'\\' => b'\\',
            0x08 => b'b',
            0x09 => b't',
            0x0a => b'n',
            0x0c => b'f',
            0x0d => b'r',
            0x00..=0x1f => 0,
            _ => continue,
        };
        out.extend_from_slice(&bytes[run..i]);
        run = i + 1;
        out.push(b'\\');
        if short == 0 {
            out.extend_from_slice(b"u00");
            out.push(crate::hex::DIGITS[usize::from(b >> 4)]);
            out.push(crate::hex::DIGITS[usize::from(b & 0xf)]);
        } else {
            out.push(short);
        }
    }
    out.extend_from_slice(&bytes[run..]);
    out.push(b'"');
}

/// Writes a number (its text valid JSON) with its exact value, in ECMAScript's layout (see
/// the module docs). `None` when its exponent, as written or in `e` notation after the first
/// significant digit, does not fit in 64 bits.
pub(super) fn write_number(text: &str, out: &mut Vec<u8>) -> Option<()> {
    let (negative, unsigned) = match text.strip_prefix('-') {
        Some(rest) => (true, rest),
        None => (false, text),
    };
    let (mantissa, exponent) = match unsigned.find(['e', 'E']) {
        Some(i) => (&unsigned[..i], parse_exponent(&unsigned[i + 1..])?),
        None => (unsigned, 0),
    };
    let (int, frac) = mantissa.split_once('.').unwrap_or((mantissa, ""));
    // The value is int.frac × 10^exponent = D × 10^(exponent - len(frac)), D the digits of
    // int and frac together. Leading zeros of D do not count; trailing ones move into the
    // exponent.
    let all = || int.bytes().chain(frac.bytes());
    let total = int.len() + frac.len();
    let leading = all().take_while(|&d| d == b'0').count();
    if leading == total {
        out.push(b'0');
        return Some(());
    }
    let trailing = frac
        .bytes()
        .rev()
        .chain(int.bytes().rev())
        .take_while(|&d| d == b'0')
        .count();
    let digits: Vec<u8> = all()
        .skip(leading)
        .take(total - leading - trailing)
        .collect();
    let k = i128::try_from(digits.len()).ok()?;
    let frac_len = i128::try_from(frac.len()).ok()?;
    let trailing = i128::try_from(trailing).ok()?;
    // ECMAScript's n: the value is 0.digits × 10^n.
    let n = exponent - frac_len + trailing + k;
    // The exponent written after `e` must read back (see `parse_exponent`), or the canonical
    // form would not be a fixed point.
    i64::try_from((n - 1).unsigned_abs()).ok()?;
    if negative {
        out.push(b'-');
    }
    layout(&digits, n, out);
    Some(())
}

/// The exponent after `e`: an optional sign and digits, within `i64`.
pub(super) fn parse_exponent(text: &str) -> Option<i128> {
    let (negative, digits) = match text.as_bytes().first() {
        Some(b'-') => (true, &text[1..]),
        Some(b'+') => (false, &text[1..]),
        _ => (false, text),
    };
    let digits = digits.trim_start_matches('0');
    if digits.is_empty() {
        return Some(0);
    }
    let value: i64 = digits.parse().ok()?;
    let value = i128::from(value);
    Some(if negative { -value } else { value })
}

/// ECMAScript's `Number::toString` layout of `0.digits × 10^n` (`digits` without leading or
/// trailing zeros, not empty).
pub(super) fn layout(digits: &[u8], n: i128, out: &mut Vec<u8>) {
    let k = i128::try_from(digits.len()).unwrap_or(i128::MAX);
    let zeros = |count: i128, out: &mut Vec<u8>| {
        for _ in 0..count {
            out.push(b'0');
        }
    };
    if k <= n && n <= 21 {
        out.extend_from_slice(digits);
        zeros(n - k, out);
    } else if 0 < n && n <= 21 {
        // 0 < n < k here, so n is a position within `digits`.
        let point = usize::try_from(n).unwrap_or(0);
        out.extend_from_slice(&digits[..point]);
        out.push(b'.');
        out.extend_from_slice(&digits[point..]);
    } else if -6 < n && n <= 0 {
        out.extend_from_slice(b"0.");
        zeros(-n, out);
        out.extend_from_slice(digits);
    } else {
        out.push(digits[0]);
        if digits.len() > 1 {
            out.push(b'.');
            out.extend_from_slice(&digits[1..]);
        }
        let e = n - 1;
        out.push(b'e');
        out.push(if e < 0 { b'-' } else { b'+' });
        out.extend_from_slice(e.unsigned_abs().to_string().as_bytes());
    }
}
