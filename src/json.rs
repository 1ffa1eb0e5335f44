//! A strict JSON parser and the canonical form of a JSON text (RFC 8785, JCS), for
//! [`JsonFingerprint`](crate::fingerprint::JsonFingerprint).
//!
//! The canonical form is the one RFC 8785 specifies:
//!
//! - no insignificant whitespace;
//! - object members sorted by the UTF-16 code units of their names;
//! - strings written with the fewest escapes: `\"`, `\\`, the short forms `\b` `\t` `\n` `\f`
//!   `\r`, `\u00xx` (lower-case hex) for the other control characters, every other character
//!   as itself in UTF-8;
//! - `true`, `false` and `null` as they are;
//! - numbers as ECMAScript's `Number.prototype.toString` writes them: the significant digits
//!   without leading or trailing zeros, plain notation when the decimal exponent is in
//!   `-7 < e < 21`, otherwise `d.ddde+x` / `d.ddde-x`; `-0` is `0`.
//!
//! # Numbers: exact, where RFC 8785 would round
//!
//! RFC 8785 writes a number as the shortest decimal that reads back as the IEEE 754 double
//! nearest to it. Two texts of different values that round to the same double (the amounts
//! `9007199254740993` and `9007199254740992`, or `333333333.33333329` and
//! `333333333.3333333`) would then share a canonical form, and a retry with another amount
//! would be replayed instead of refused. So this canonicaliser never rounds: a number is
//! written, in ECMAScript's layout, with the exact decimal value of its text. Wherever the
//! text is the double's shortest decimal (what a conforming JCS or ECMAScript serialiser
//! sends, and every number in RFC 8785's examples that is not there to show rounding) the
//! result is byte for byte RFC 8785's; where the double would have lost digits, the digits
//! are kept. Two numbers share a canonical form exactly when their decimal values are equal
//! (`4.50`, `4.5`, `45e-1` and `0.45E1` do). A number whose exponent does not fit in 64 bits,
//! as written or in `e` notation after its first significant digit (`10e9223372036854775807`),
//! makes the text invalid here (the caller falls back to the raw bytes).
//!
//! # Rejected texts
//!
//! The parser accepts RFC 8259 JSON only, and rejects (returns `None` for) invalid UTF-8, a
//! byte order mark, a lone surrogate escape (`"\ud800"`), a duplicate member name in an
//! object (RFC 8785 requires it; `"a"` and `"\u0061"` are the same name), nesting deeper than
//! [`MAX_DEPTH`], and anything after the value but whitespace. It never panics, and its
//! recursion is bounded by [`MAX_DEPTH`].

use std::borrow::Cow;
use std::cmp::Ordering;

/// The deepest nesting of arrays and objects accepted. Deeper texts are refused, so that a
/// hostile body cannot exhaust the stack.
pub(crate) const MAX_DEPTH: usize = 128;

/// A parsed JSON value. Strings without escapes borrow from the text.
#[derive(Debug, PartialEq)]
pub(crate) enum Value<'a> {
    Null,
    Bool(bool),
    /// The number's text, as written (validated against the JSON grammar).
    Number(&'a str),
    String(Cow<'a, str>),
    Array(Vec<Value<'a>>),
    /// Members sorted by the UTF-16 code units of their names, without duplicates.
    Object(Vec<(Cow<'a, str>, Value<'a>)>),
}

/// Parses `body` as one JSON text; `None` when it is not valid (see the module docs).
pub(crate) fn parse(body: &[u8]) -> Option<Value<'_>> {
    let text = std::str::from_utf8(body).ok()?;
    let mut parser = Parser { text, pos: 0 };
    parser.whitespace();
    let value = parser.value(0)?;
    parser.whitespace();
    (parser.pos == text.len()).then_some(value)
}

/// The canonical form of the JSON text `body`, or `None` when it is not valid JSON.
#[cfg(test)]
pub(crate) fn canonicalize(body: &[u8]) -> Option<Vec<u8>> {
    let value = parse(body)?;
    let mut out = Vec::with_capacity(body.len());
    write(&value, &mut out)?;
    Some(out)
}

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

/// Replaces the value at `pointer` (RFC 6901 reference tokens, unescaped) so that it no
/// longer counts: an object member is removed, an array element becomes `null` (the other
/// elements keep their places), the whole document (no tokens) becomes `null`. A pointer
/// to nothing changes nothing.
pub(crate) fn exclude(value: &mut Value<'_>, pointer: &[String]) {
    let Some((last, path)) = pointer.split_last() else {
        *value = Value::Null;
        return;
    };
    let mut target = value;
    for token in path {
        let next = match target {
            Value::Object(members) => members
                .iter_mut()
                .find(|(name, _)| name == token)
                .map(|(_, v)| v),
            Value::Array(items) => array_index(token).and_then(|i| items.get_mut(i)),
            _ => None,
        };
        match next {
            Some(next) => target = next,
            None => return,
        }
    }
    match target {
        Value::Object(members) => members.retain(|(name, _)| name != last),
        Value::Array(items) => {
            if let Some(item) = array_index(last).and_then(|i| items.get_mut(i)) {
                *item = Value::Null;
            }
        }
        _ => {}
    }
}

/// An RFC 6901 array index: `0`, or digits without a leading zero.
fn array_index(token: &str) -> Option<usize> {
    let digits = token.bytes().all(|b| b.is_ascii_digit());
    if !digits || token.is_empty() || (token.len() > 1 && token.starts_with('0')) {
        return None;
    }
    token.parse().ok()
}

/// Splits an RFC 6901 JSON Pointer into its reference tokens, with `~1` and `~0` unescaped.
/// `None` when it is not a pointer: it does not start with `/` (and is not empty), or a `~`
/// is not followed by `0` or `1`.
pub(crate) fn parse_pointer(pointer: &str) -> Option<Vec<String>> {
    if pointer.is_empty() {
        return Some(Vec::new());
    }
    let rest = pointer.strip_prefix('/')?;
    rest.split('/')
        .map(|token| {
            let mut out = String::with_capacity(token.len());
            let mut chars = token.chars();
            while let Some(c) = chars.next() {
                if c == '~' {
                    match chars.next() {
                        Some('0') => out.push('~'),
                        Some('1') => out.push('/'),
                        _ => return None,
                    }
                } else {
                    out.push(c);
                }
            }
            Some(out)
        })
        .collect()
}

struct Parser<'a> {
    text: &'a str,
    pos: usize,
}

impl<'a> Parser<'a> {
    fn peek(&self) -> Option<u8> {
        self.text.as_bytes().get(self.pos).copied()
    }

    fn whitespace(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.pos += 1;
        }
    }

    fn eat(&mut self, byte: u8) -> Option<()> {
        (self.peek() == Some(byte)).then(|| self.pos += 1)
    }

    fn literal(&mut self, word: &str, value: Value<'a>) -> Option<Value<'a>> {
        let end = self.pos.checked_add(word.len())?;
        (self.text.as_bytes().get(self.pos..end)? == word.as_bytes()).then(|| {
            self.pos = end;
            value
        })
    }

    /// A value; `depth` is the number of arrays and objects around it.
    fn value(&mut self, depth: usize) -> Option<Value<'a>> {
        match self.peek()? {
            b'{' => self.object(depth + 1),
            b'[' => self.array(depth + 1),
            b'"' => self.string().map(Value::String),
            b't' => self.literal("true", Value::Bool(true)),
            b'f' => self.literal("false", Value::Bool(false)),
            b'n' => self.literal("null", Value::Null),
            b'-' | b'0'..=b'9' => self.number(),
            _ => None,
        }
    }

    fn array(&mut self, depth: usize) -> Option<Value<'a>> {
        if depth > MAX_DEPTH {
            return None;
        }
        self.eat(b'[')?;
        self.whitespace();
        let mut items = Vec::new();
        if self.eat(b']').is_some() {
            return Some(Value::Array(items));
        }
        loop {
            items.push(self.value(depth)?);
            self.whitespace();
            match self.peek()? {
                b',' => {
                    self.pos += 1;
                    self.whitespace();
                }
                b']' => {
                    self.pos += 1;
                    return Some(Value::Array(items));
                }
                _ => return None,
            }
        }
    }

    fn object(&mut self, depth: usize) -> Option<Value<'a>> {
        if depth > MAX_DEPTH {
            return None;
        }
        self.eat(b'{')?;
        self.whitespace();
        let mut members = Vec::new();
        if self.eat(b'}').is_none() {
            loop {
                let name = self.string()?;
                self.whitespace();
                self.eat(b':')?;
                self.whitespace();
                members.push((name, self.value(depth)?));
                self.whitespace();
                match self.peek()? {
                    b',' => {
                        self.pos += 1;
                        self.whitespace();
                    }
                    b'}' => {
                        self.pos += 1;
                        break;
                    }
                    _ => return None,
                }
            }
        }
        members.sort_by(|(a, _), (b, _)| utf16_cmp(a, b));
        if members.windows(2).any(|w| w[0].0 == w[1].0) {
            return None;
        }
        Some(Value::Object(members))
    }

    /// A string, its escapes decoded.
    fn string(&mut self) -> Option<Cow<'a, str>> {
        self.eat(b'"')?;
        let bytes = self.text.as_bytes();
        let start = self.pos;
        // The common case: no escapes, borrowed as it is.
        loop {
            match *bytes.get(self.pos)? {
                b'"' => {
                    let s = self.text.get(start..self.pos)?;
                    self.pos += 1;
                    return Some(Cow::Borrowed(s));
                }
                b'\\' => break,
                0x00..=0x1f => return None,
                _ => self.pos += 1,
            }
        }
        let mut out = String::from(self.text.get(start..self.pos)?);
        let mut run = self.pos;
        loop {
            match *bytes.get(self.pos)? {
                b'"' => {
                    out.push_str(self.text.get(run..self.pos)?);
                    self.pos += 1;
                    return Some(Cow::Owned(out));
                }
                b'\\' => {
                    out.push_str(self.text.get(run..self.pos)?);
                    self.pos += 1;
                    let escaped = *bytes.get(self.pos)?;
                    self.pos += 1;
                    match escaped {
                        b'"' => out.push('"'),
                        b'\\' => out.push('\\'),
                        b'/' => out.push('/'),
                        b'b' => out.push('\u{8}'),
                        b'f' => out.push('\u{c}'),
                        b'n' => out.push('\n'),
                        b'r' => out.push('\r'),
                        b't' => out.push('\t'),
                        b'u' => out.push(self.unicode_escape()?),
                        _ => return None,
                    }
                    run = self.pos;
                }
                0x00..=0x1f => return None,
                _ => self.pos += 1,
            }
        }
    }

    /// The character of a `\u` escape (the `\u` already read), joining a surrogate pair.
    fn unicode_escape(&mut self) -> Option<char> {
        let first = self.hex4()?;
        match first {
            0xd800..=0xdbff => {
                self.eat(b'\\')?;
                self.eat(b'u')?;
                let second = self.hex4()?;
                if !(0xdc00..=0xdfff).contains(&second) {
                    return None;
                }
                let c =
                    0x10000 + ((u32::from(first) - 0xd800) << 10) + (u32::from(second) - 0xdc00);
                char::from_u32(c)
            }
            0xdc00..=0xdfff => None,
            _ => char::from_u32(u32::from(first)),
        }
    }

    fn hex4(&mut self) -> Option<u16> {
        let end = self.pos.checked_add(4)?;
        let digits = self.text.as_bytes().get(self.pos..end)?;
        let mut n = 0u16;
        for &d in digits {
            let v = char::from(d).to_digit(16)?;
            n = (n << 4) | u16::try_from(v).ok()?;
        }
        self.pos = end;
        Some(n)
    }

    /// A number: `-? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)?`, kept as text.
    fn number(&mut self) -> Option<Value<'a>> {
        let start = self.pos;
        let _ = self.eat(b'-');
        match self.peek()? {
            b'0' => self.pos += 1,
            b'1'..=b'9' => self.digits(),
            _ => return None,
        }
        if self.eat(b'.').is_some() {
            self.require_digits()?;
        }
        if let Some(b'e' | b'E') = self.peek() {
            self.pos += 1;
            if let Some(b'+' | b'-') = self.peek() {
                self.pos += 1;
            }
            self.require_digits()?;
        }
        Some(Value::Number(self.text.get(start..self.pos)?))
    }

    fn digits(&mut self) {
        while let Some(b'0'..=b'9') = self.peek() {
            self.pos += 1;
        }
    }

    fn require_digits(&mut self) -> Option<()> {
        let start = self.pos;
        self.digits();
        (self.pos > start).then_some(())
    }
}

/// Orders two strings by their UTF-16 code units, as RFC 8785 sorts member names.
fn utf16_cmp(a: &str, b: &str) -> Ordering {
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
fn write_string(s: &str, out: &mut Vec<u8>) {
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
fn write_number(text: &str, out: &mut Vec<u8>) -> Option<()> {
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
fn parse_exponent(text: &str) -> Option<i128> {
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
fn layout(digits: &[u8], n: i128, out: &mut Vec<u8>) {
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

#[cfg(test)]
mod tests {
    use super::*;

    fn canon(text: &str) -> String {
        let out = canonicalize(text.as_bytes()).unwrap_or_else(|| panic!("invalid: {text:?}"));
        String::from_utf8(out).unwrap()
    }

    fn number(text: &str) -> String {
        canon(text)
    }

    /// ECMAScript's `Number.prototype.toString` of a finite double, from Rust's shortest
    /// round-trip digits (`{:e}`): the reference the canonical numbers are checked against.
    fn es(x: f64) -> String {
        if x == 0.0 {
            return "0".to_owned();
        }
        let sci = format!("{:e}", x.abs());
        let (mantissa, exp) = sci.split_once('e').unwrap();
        let digits: Vec<u8> = mantissa.bytes().filter(u8::is_ascii_digit).collect();
        let n = i128::from(exp.parse::<i32>().unwrap()) + 1;
        let mut out = Vec::new();
        if x < 0.0 {
            out.push(b'-');
        }
        layout(&digits, n, &mut out);
        String::from_utf8(out).unwrap()
    }

    // RFC 8785, Appendix B: IEEE 754 doubles and their serialisation.
    const APPENDIX_B: &[(u64, &str)] = &[
        (0x0000000000000000, "0"),
        (0x8000000000000000, "0"),
        (0x0000000000000001, "5e-324"),
        (0x8000000000000001, "-5e-324"),
        (0x7fefffffffffffff, "1.7976931348623157e+308"),
        (0xffefffffffffffff, "-1.7976931348623157e+308"),
        (0x4340000000000000, "9007199254740992"),
        (0xc340000000000000, "-9007199254740992"),
        (0x4430000000000000, "295147905179352830000"),
        (0x44b52d02c7e14af5, "9.999999999999997e+22"),
        (0x44b52d02c7e14af6, "1e+23"),
        (0x44b52d02c7e14af7, "1.0000000000000001e+23"),
        (0x444b1ae4d6e2ef4e, "999999999999999700000"),
        (0x444b1ae4d6e2ef4f, "999999999999999900000"),
        (0x444b1ae4d6e2ef50, "1e+21"),
        (0x3eb0c6f7a0b5ed8c, "9.999999999999997e-7"),
        (0x3eb0c6f7a0b5ed8d, "0.000001"),
        (0x41b3de4355555553, "333333333.3333332"),
        (0x41b3de4355555554, "333333333.33333325"),
        (0x41b3de4355555555, "333333333.3333333"),
        (0x41b3de4355555556, "333333333.3333334"),
        (0x41b3de4355555557, "333333333.33333343"),
        (0xbecbf647612f3696, "-0.0000033333333333333333"),
    ];

    #[test]
    fn rfc_8785_appendix_b_numbers() {
        for &(bits, expected) in APPENDIX_B {
            let x = f64::from_bits(bits);
            // The reference layout agrees with the RFC's table...
            assert_eq!(es(x), expected, "{bits:#018x}");
            // ...and the canonical form of the double's shortest text, written the way
            // ECMAScript writes it and the way Rust writes it (plain digits), is the RFC's.
            assert_eq!(number(expected), expected, "{bits:#018x}");
            assert_eq!(number(&format!("{x}")), expected, "{bits:#018x}: {x}");
            assert_eq!(number(&format!("{x:e}")), expected, "{bits:#018x}: {x:e}");
        }
    }

    #[test]
    fn rfc_8785_numbers_of_the_text() {
        // Section 3.2.2.3 and the "values" example.
        assert_eq!(number("1E30"), "1e+30");
        assert_eq!(number("1e+30"), "1e+30");
        assert_eq!(number("4.50"), "4.5");
        assert_eq!(number("2e-3"), "0.002");
        assert_eq!(number("0.000001"), "0.000001");
        assert_eq!(number("1e-7"), "1e-7");
        assert_eq!(number("0.0000001"), "1e-7");
        assert_eq!(number("0.000000000000000000000000001"), "1e-27");
        assert_eq!(number("9007199254740992"), "9007199254740992");
        assert_eq!(number("-0"), "0");
        assert_eq!(number("-0.0e-5"), "0");
        assert_eq!(number("1e21"), "1e+21");
        assert_eq!(number("1e20"), "100000000000000000000");
        assert_eq!(number("123456789012345678901"), "123456789012345678901");
        assert_eq!(number("10"), "10");
        assert_eq!(number("0.5"), "0.5");
        assert_eq!(number("-1.5e3"), "-1500");
        assert_eq!(number("45e-1"), "4.5");
        assert_eq!(number("0.45E1"), "4.5");
        assert_eq!(number("1.2345e-10"), "1.2345e-10");
    }

    /// The deliberate deviation: where a double would lose digits, the exact value is kept.
    #[test]
    fn money_safe_rule_keeps_digits_a_double_would_lose() {
        // RFC 8785 writes 333333333.3333333 (the nearest double's shortest form).
        assert_eq!(number("333333333.33333329"), "333333333.33333329");
        assert_ne!(number("333333333.33333329"), number("333333333.3333333"));
        // Integers above 2^53: RFC 8785 writes both as 9007199254740992.
        assert_eq!(number("9007199254740993"), "9007199254740993");
        assert_ne!(number("9007199254740993"), number("9007199254740992"));
        // Amounts that differ past a double's 17 digits stay apart.
        assert_ne!(
            number("12345678901234567890.01"),
            number("12345678901234567890.02")
        );
        // Out of a double's range: RFC 8785 has no form for them (Infinity, or 0).
        assert_eq!(number("1e400"), "1e+400");
        assert_eq!(number("-2.5e-400"), "-2.5e-400");
        assert_ne!(number("1e-400"), "0");
        assert_eq!(number("1e999999999999999999"), "1e+999999999999999999");
        // An exponent beyond 64 bits is refused (the caller falls back to the raw bytes).
        assert_eq!(canonicalize(b"1e99999999999999999999"), None);
        assert_eq!(canonicalize(b"[1e-99999999999999999999]"), None);
    }

    /// The canonical form is a fixed point at the edge of the exponent's range too: a number
    /// whose exponent fits in 64 bits as written but not once it is moved behind the first
    /// significant digit is refused, not written as a form that is itself refused.
    #[test]
    fn a_canonical_exponent_beyond_64_bits_is_refused() {
        for text in [
            "10e9223372036854775807",
            "0.01e-9223372036854775807",
            "0.1e-9223372036854775807",
            "[1, 100e9223372036854775806]",
        ] {
            assert_eq!(canonicalize(text.as_bytes()), None, "{text}");
        }
        for (text, expected) in [
            ("1e9223372036854775807", "1e+9223372036854775807"),
            ("10e9223372036854775806", "1e+9223372036854775807"),
            ("1e-9223372036854775807", "1e-9223372036854775807"),
            ("0.1e-9223372036854775806", "1e-9223372036854775807"),
        ] {
            assert_eq!(number(text), expected, "{text}");
            assert_eq!(number(expected), expected, "{text}");
        }
    }

    /// Canonicalising the shortest text of any double gives ECMAScript's `toString`, whether
    /// the text is plain or in exponent form: the exact rule agrees with RFC 8785 on every
    /// text a conforming serialiser produces.
    #[test]
    fn random_doubles_canonicalise_as_ecmascript_writes_them() {
        let mut state = 0x9e37_79b9_7f4a_7c15_u64;
        let mut next = move || {
            // xorshift64*
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            state.wrapping_mul(0x2545_f491_4f6c_dd1d)
        };
        for i in 0..20_000 {
            let x = match i % 3 {
                0 => f64::from_bits(next()),
                #[allow(clippy::cast_precision_loss)]
                1 => (next() % 10_000_000_000) as f64 / 100.0,
                #[allow(clippy::cast_precision_loss, clippy::cast_possible_wrap)]
                _ => (next() as i64) as f64,
            };
            if !x.is_finite() {
                continue;
            }
            let expected = es(x);
            assert_eq!(number(&format!("{x}")), expected, "{x:?}");
            assert_eq!(number(&format!("{x:e}")), expected, "{x:e}");
            assert_eq!(number(&expected), expected, "{x:?}");
        }
    }

    #[test]
    fn rfc_8785_section_3_2_2_values_example() {
        let input = r#"{
  "numbers": [333333333.33333329, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],
  "string": "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/",
  "literals": [null, true, false]
}"#;
        // The RFC's output, except its first number (the money-safe rule keeps its digits:
        // RFC 8785 writes 333333333.3333333).
        let expected = r#"{"literals":[null,true,false],"numbers":[333333333.33333329,1e+30,4.5,0.002,1e-27],"string":"€$\u000f\nA'B\"\\\\\"/"}"#;
        assert_eq!(canon(input), expected);
        // With the RFC's own shortest form of that number, the output is the RFC's.
        let rfc = input.replace("333333333.33333329", "333333333.3333333");
        assert_eq!(
            canon(&rfc),
            r#"{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],"string":"€$\u000f\nA'B\"\\\\\"/"}"#
        );
    }

    /// The reference implementation's own files (cyberphone/json-canonicalization,
    /// `testdata/input` and `testdata/output`), byte for byte; the tests below are variants.
    #[test]
    fn reference_testdata_files() {
        let structures_in = "{\n  \"1\": {\"f\": {\"f\": \"hi\",\"F\": 5} ,\"\\n\": 56.0},\n  \"10\": { },\n  \"\": \"empty\",\n  \"a\": { },\n  \"111\": [ { } ],\n  \"A\": { }\n}";
        let structures_out = "{\"\":\"empty\",\"1\":{\"\\n\":56,\"f\":{\"F\":5,\"f\":\"hi\"}},\"10\":{},\"111\":[{}],\"A\":{},\"a\":{}}";
        assert_eq!(canon(structures_in), structures_out);

        let weird_in = "{\n  \"\\u20ac\": \"Euro Sign\",\n  \"1\": \"One\",\n  \"\\u0080\": \"Control\\u007f\",\n  \"\\ud83d\\ude02\": \"Smiley\",\n  \"\\u00f6\": \"Latin Small Letter O With Diaeresis\",\n  \"\\ufb33\": \"Hebrew Letter Dalet With Dagesh\",\n  \"</script>\": \"Browser Challenge\"\n}\n";
        let weird_out = "{\"1\":\"One\",\"</script>\":\"Browser Challenge\",\"\u{80}\":\"Control\u{7f}\",\"\u{f6}\":\"Latin Small Letter O With Diaeresis\",\"\u{20ac}\":\"Euro Sign\",\"\u{1f602}\":\"Smiley\",\"\u{fb33}\":\"Hebrew Letter Dalet With Dagesh\"}";
        assert_eq!(canon(weird_in), weird_out);

        let values_in = "{\n  \"numbers\": [1E30, 4.50, 333333333.33333329, 2e-3, 0.000000000000000000000000001],\n  \"escaping\": \"\\u20ac$\\u000F\\u000aA'\\u0042\\u0022\\u005c\\\\\\\"\\/\",\n  \"literals\": [null, true, false]\n}";
        let values_out = "{\"escaping\":\"\u{20ac}$\\u000f\\nA'B\\\"\\\\\\\\\\\"/\",\"literals\":[null,true,false],\"numbers\":[1e+30,4.5,333333333.3333333,0.002,1e-27]}";
        // The one number a double cannot hold is kept exact (the money-safe rule); with the
        // RFC's shortest form in the input, the output is the reference file's.
        assert_eq!(
            canon(values_in),
            values_out.replace("333333333.3333333", "333333333.33333329")
        );
        assert_eq!(
            canon(&values_in.replace("333333333.33333329", "333333333.3333333")),
            values_out
        );
    }

    // cyberphone/json-canonicalization testdata (the RFC's reference implementation).
    #[test]
    fn testdata_arrays() {
        let input = r#"[
  56,
  {
    "d": true,
    "10": null,
    "1": [ ]
  }
]"#;
        assert_eq!(canon(input), r#"[56,{"1":[],"10":null,"d":true}]"#);
    }

    #[test]
    fn testdata_french() {
        let input = r#"{
  "peach": "This sorting order",
  "péché": "is wrong according to French",
  "pêche": "but canonicalization MUST",
  "sin":   "ignore locale"
}"#;
        assert_eq!(
            canon(input),
            r#"{"peach":"This sorting order","péché":"is wrong according to French","pêche":"but canonicalization MUST","sin":"ignore locale"}"#
        );
    }

    #[test]
    fn testdata_structures() {
        let input = r#"{
  "1": {"f": {"f": "hi","F": 5} ,"\n": 56.0},
  "10": { },
  "": "empty",
  "a": { },
  "111": [ {"e": "yes","E": "no" } ],
  "A": { }
}"#;
        assert_eq!(
            canon(input),
            r#"{"":"empty","1":{"\n":56,"f":{"F":5,"f":"hi"}},"10":{},"111":[{"E":"no","e":"yes"}],"A":{},"a":{}}"#
        );
    }

    #[test]
    fn testdata_unicode() {
        let input = "{\n  \"Unnormalized Unicode\":\"A\\u030a\"\n}";
        assert_eq!(canon(input), "{\"Unnormalized Unicode\":\"A\u{30a}\"}");
    }

    #[test]
    fn testdata_values() {
        let input = r#"{
  "numbers": [333333333.3333333, 1E30, 4.50, 2e-3, 0.000000000000000000000000001],
  "string": "\u20ac$\u000F\u000aA'\u0042\u0022\u005c\\\"\/",
  "literals": [null, true, false]
}"#;
        assert_eq!(
            canon(input),
            r#"{"literals":[null,true,false],"numbers":[333333333.3333333,1e+30,4.5,0.002,1e-27],"string":"€$\u000f\nA'B\"\\\\\"/"}"#
        );
    }

    #[test]
    fn testdata_weird() {
        let input = r#"{
  "\u20ac": "Euro Sign",
  "\r": "Carriage Return",
  "\u000a": "Newline",
  "1": "One",
  "\u0080": "Control\u007f",
  "\ud83d\ude02": "Smiley",
  "\u00f6": "Latin Small Letter O With Diaeresis",
  "\ufb33": "Hebrew Letter Dalet With Dagesh",
  "</script>": "Browser Challenge"
}"#;
        let expected = "{\"\\n\":\"Newline\",\"\\r\":\"Carriage Return\",\"1\":\"One\",\"</script>\":\"Browser Challenge\",\"\u{80}\":\"Control\u{7f}\",\"ö\":\"Latin Small Letter O With Diaeresis\",\"€\":\"Euro Sign\",\"😂\":\"Smiley\",\"דּ\":\"Hebrew Letter Dalet With Dagesh\"}";
        assert_eq!(canon(input), expected);
    }

    #[test]
    fn utf16_order_differs_from_code_point_order() {
        // U+1F602 is D83D DE02 in UTF-16: before U+FB33, though its code point is larger.
        assert_eq!(utf16_cmp("\u{1f602}", "\u{fb33}"), Ordering::Less);
        assert_eq!(utf16_cmp("a\u{1f602}", "a\u{e000}"), Ordering::Less);
        assert_eq!(utf16_cmp("\u{e000}", "\u{ffff}"), Ordering::Less);
        assert_eq!(utf16_cmp("b", "a\u{1f602}"), Ordering::Greater);
        assert_eq!(utf16_cmp("ab", "a"), Ordering::Greater);
    }

    #[test]
    fn strings_are_escaped_as_rfc_8785_says() {
        assert_eq!(
            canon(r#""\u0000\u0001\b\t\n\u000b\f\r\u001f \u007f\u2028""#),
            "\"\\u0000\\u0001\\b\\t\\n\\u000b\\f\\r\\u001f \u{7f}\u{2028}\""
        );
        assert_eq!(canon(r#""\/\"\\""#), r#""/\"\\""#);
        assert_eq!(canon(r#""\uD83D\uDE02""#), "\"😂\"");
    }

    #[test]
    fn whitespace_and_member_order_do_not_matter() {
        assert_eq!(
            canonicalize(b" { \"b\" : [1, 2.0 ] ,\r\n\t\"a\":{\"y\":null,\"x\":\"s\"} } "),
            canonicalize(b"{\"a\":{\"x\":\"s\",\"y\":null},\"b\":[1,2]}")
        );
        assert_eq!(canon("\"x\""), "\"x\"");
        assert_eq!(canon(" 12 "), "12");
        assert_eq!(canon("true"), "true");
    }

    #[test]
    fn invalid_texts_are_refused() {
        let invalid: &[&[u8]] = &[
            b"",
            b" ",
            b"{",
            b"}",
            b"[",
            b"[1,]",
            b"[,1]",
            b"{\"a\":1,}",
            b"{\"a\" 1}",
            b"{a:1}",
            b"{\"a\":1 \"b\":2}",
            b"{\"a\":1,\"a\":2}",
            b"{\"a\":1,\"\\u0061\":2}",
            b"'a'",
            b"\"abc",
            b"\"a\\x\"",
            b"\"a\\u12\"",
            b"\"a\\u12g4\"",
            b"\"\\ud800\"",
            b"\"\\udc00\"",
            b"\"\\ud800\\u0041\"",
            b"\"\\ud800x\"",
            b"\"tab\there\"",
            b"\"\n\"",
            b"\xff",
            b"\"\xc3\x28\"",
            b"\xef\xbb\xbf{}",
            b"01",
            b"-",
            b"+1",
            b"1.",
            b".5",
            b"1e",
            b"1e+",
            b"0x10",
            b"NaN",
            b"Infinity",
            b"-Infinity",
            b"tru",
            b"nul",
            b"falsey",
            b"1 2",
            b"{} {}",
            b"[1] x",
            b"\x00",
            b"[\"a\"\x0c]",
        ];
        for text in invalid {
            assert_eq!(
                canonicalize(text),
                None,
                "accepted {:?}",
                String::from_utf8_lossy(text)
            );
        }
    }

    #[test]
    fn nesting_is_bounded() {
        let deep = |n: usize| format!("{}{}", "[".repeat(n), "]".repeat(n));
        assert!(canonicalize(deep(MAX_DEPTH).as_bytes()).is_some());
        assert!(canonicalize(deep(MAX_DEPTH + 1).as_bytes()).is_none());
        let objects = |n: usize| format!("{}1{}", "{\"a\":".repeat(n), "}".repeat(n));
        assert!(canonicalize(objects(MAX_DEPTH).as_bytes()).is_some());
        assert!(canonicalize(objects(MAX_DEPTH + 1).as_bytes()).is_none());
        // Far too deep: refused, no stack overflow.
        assert!(canonicalize(deep(1_000_000).as_bytes()).is_none());
        assert!(canonicalize("[".repeat(1_000_000).as_bytes()).is_none());
    }

    /// Random bytes, and random mutations of valid texts: never a panic, and whatever is
    /// accepted canonicalises to a fixed point.
    #[test]
    fn no_input_panics() {
        let seeds: &[&[u8]] = &[
            br#"{"a":[1,2.5e-3,-0,{"b":"\u00e9\ud83d\ude02"}],"c":true,"d":null}"#,
            br#"[333333333.33333329, 1E30, 4.50, "x\n", {"":{}}]"#,
            b"\"\\u0000\\\\\"",
        ];
        let mut state = 0x2545_f491_4f6c_dd1d_u64;
        let mut next = move || {
            state ^= state >> 12;
            state ^= state << 25;
            state ^= state >> 27;
            state.wrapping_mul(0x9e37_79b9_7f4a_7c15)
        };
        let alphabet = b"{}[]\",:\\u0123456789abcdefABCDEF.eE+- \t\n\rtruefalsnl\xc3\xa9\xff\x00";
        for round in 0..30_000 {
            let mut text: Vec<u8> = if round % 2 == 0 {
                seeds[usize::try_from(next() % 3).unwrap()].to_vec()
            } else {
                Vec::new()
            };
            let edits = next() % 8 + 1;
            for _ in 0..edits {
                let byte = alphabet[usize::try_from(next() % alphabet.len() as u64).unwrap()];
                let at = usize::try_from(next() % (text.len() as u64 + 1)).unwrap();
                match next() % 3 {
                    0 => text.insert(at, byte),
                    1 if at < text.len() => text[at] = byte,
                    _ if at < text.len() => {
                        text.remove(at);
                    }
                    _ => text.push(byte),
                }
            }
            if let Some(canonical) = canonicalize(&text) {
                assert_eq!(
                    canonicalize(&canonical).as_deref(),
                    Some(&canonical[..]),
                    "not a fixed point: {:?}",
                    String::from_utf8_lossy(&text)
                );
            }
        }
    }

    #[test]
    fn pointers_parse_as_rfc_6901_says() {
        assert_eq!(parse_pointer(""), Some(vec![]));
        assert_eq!(parse_pointer("/"), Some(vec![String::new()]));
        assert_eq!(
            parse_pointer("/metadata/request_id"),
            Some(vec!["metadata".to_owned(), "request_id".to_owned()])
        );
        assert_eq!(
            parse_pointer("/a~1b/m~0n/~01"),
            Some(vec!["a/b".to_owned(), "m~n".to_owned(), "~1".to_owned()])
        );
        assert_eq!(parse_pointer("a"), None);
        assert_eq!(parse_pointer("/a~"), None);
        assert_eq!(parse_pointer("/a~2"), None);
        assert_eq!(parse_pointer("#/a"), None);
    }

    fn excluded(text: &str, pointers: &[&str]) -> String {
        let mut value = parse(text.as_bytes()).unwrap();
        for p in pointers {
            exclude(&mut value, &parse_pointer(p).unwrap());
        }
        let mut out = Vec::new();
        write(&value, &mut out).unwrap();
        String::from_utf8(out).unwrap()
    }

    #[test]
    fn excluded_members_and_elements() {
        let doc =
            r#"{"a/b":1,"m~n":2,"meta":{"id":"x","k":3},"items":[{"ts":1,"v":2},{"ts":3,"v":4}]}"#;
        assert_eq!(
            excluded(doc, &["/meta/id"]),
            r#"{"a/b":1,"items":[{"ts":1,"v":2},{"ts":3,"v":4}],"meta":{"k":3},"m~n":2}"#
        );
        assert_eq!(
            excluded(doc, &["/a~1b", "/m~0n"]),
            r#"{"items":[{"ts":1,"v":2},{"ts":3,"v":4}],"meta":{"id":"x","k":3}}"#
        );
        assert_eq!(
            excluded(doc, &["/items/1/ts", "/items/0"]),
            r#"{"a/b":1,"items":[null,{"v":4}],"meta":{"id":"x","k":3},"m~n":2}"#
        );
        // Pointers to nothing change nothing; "01" and "-" are not indices.
        let same = excluded(doc, &[]);
        assert_eq!(
            excluded(
                doc,
                &["/nope", "/meta/id/x", "/items/2", "/items/01", "/items/-"]
            ),
            same
        );
        assert_eq!(excluded(doc, &[""]), "null");
    }
}
