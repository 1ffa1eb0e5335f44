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

mod parse;
mod write;

use parse::Parser;
use write::utf16_cmp;
pub(crate) use write::write;

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

#[cfg(test)]
mod tests {
    use std::cmp::Ordering;

    use super::write::layout;
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
