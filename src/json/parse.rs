//! The strict parser: RFC 8259 JSON in, a [`Value`] out, or `None`.

use std::borrow::Cow;

use super::*;

pub(super) struct Parser<'a> {
    pub(super) text: &'a str,
    pub(super) pos: usize,
}

impl<'a> Parser<'a> {
    pub(super) fn peek(&self) -> Option<u8> {
        self.text.as_bytes().get(self.pos).copied()
    }

    pub(super) fn whitespace(&mut self) {
        while let Some(b' ' | b'\t' | b'\n' | b'\r') = self.peek() {
            self.pos += 1;
        }
    }

    pub(super) fn eat(&mut self, byte: u8) -> Option<()> {
        (self.peek() == Some(byte)).then(|| self.pos += 1)
    }

    pub(super) fn literal(&mut self, word: &str, value: Value<'a>) -> Option<Value<'a>> {
        let end = self.pos.checked_add(word.len())?;
        (self.text.as_bytes().get(self.pos..end)? == word.as_bytes()).then(|| {
            self.pos = end;
            value
        })
    }

    /// A value; `depth` is the number of arrays and objects around it.
    pub(super) fn value(&mut self, depth: usize) -> Option<Value<'a>> {
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

    pub(super) fn array(&mut self, depth: usize) -> Option<Value<'a>> {
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

    pub(super) fn object(&mut self, depth: usize) -> Option<Value<'a>> {
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
    pub(super) fn string(&mut self) -> Option<Cow<'a, str>> {
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
    pub(super) fn unicode_escape(&mut self) -> Option<char> {
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

    pub(super) fn hex4(&mut self) -> Option<u16> {
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
    pub(super) fn number(&mut self) -> Option<Value<'a>> {
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

    pub(super) fn digits(&mut self) {
        while let Some(b'0'..=b'9') = self.peek() {
            self.pos += 1;
        }
    }

    pub(super) fn require_digits(&mut self) -> Option<()> {
        let start = self.pos;
        self.digits();
        (self.pos > start).then_some(())
    }
}
