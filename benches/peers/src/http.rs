//! A minimal HTTP/1.1 keep-alive client over a tokio `TcpStream`: one request at a time per
//! connection, written by hand into a reused buffer, answers parsed with `httparse`. Cheaper
//! in CPU than a general client, which matters with the server on the same two cores.

use std::io::Write as _;
use std::net::SocketAddr;

use anyhow::{Context, Result, bail};
use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::TcpStream;

use crate::app::TOKEN;

/// What every request carries besides its key and body.
#[derive(Clone)]
pub struct Common {
    pub host: String,
    /// The value of the `Cookie` header.
    pub cookie: String,
}

/// A request's idempotency key, written as a UUID (8-4-4-4-12 hex digits) from 128 bits.
#[derive(Clone, Copy)]
pub struct Key(pub u128);

impl std::fmt::Display for Key {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let x = self.0;
        write!(
            f,
            "{:08x}-{:04x}-{:04x}-{:04x}-{:012x}",
            (x >> 96) as u32,
            (x >> 80) as u16,
            (x >> 64) as u16,
            (x >> 48) as u16,
            x & 0xffff_ffff_ffff
        )
    }
}

/// Writes `POST {path}` with the JSON body `{"item":"book","qty":qty}` into `out`.
pub fn write_request(out: &mut Vec<u8>, common: &Common, path: &str, key: Key, qty: u64) {
    const BODY_HEAD: &str = r#"{"item":"book","qty":"#;
    let digits = qty.checked_ilog10().unwrap_or(0) as usize + 1;
    let body_len = BODY_HEAD.len() + digits + 1;
    out.clear();
    // Writing into a Vec cannot fail.
    let _ = write!(
        out,
        "POST {path} HTTP/1.1\r\nhost: {}\r\ncontent-type: application/json\r\n\
         authorization: Bearer {TOKEN}\r\ncookie: {}\r\nidempotency-key: {key}\r\n\
         content-length: {body_len}\r\n\r\n{BODY_HEAD}{qty}}}",
        common.host, common.cookie
    );
}

/// Writes `POST {path}` with no key and no body.
pub fn write_bare_request(out: &mut Vec<u8>, common: &Common, path: &str) {
    out.clear();
    let _ = write!(
        out,
        "POST {path} HTTP/1.1\r\nhost: {}\r\nauthorization: Bearer {TOKEN}\r\n\
         content-length: 0\r\n\r\n",
        common.host
    );
}

/// A whole answer, for the checks.
#[derive(Clone, Debug)]
pub struct Reply {
    pub status: u16,
    pub headers: Vec<(String, Vec<u8>)>,
    pub body: Vec<u8>,
}

/// How a response's body is framed.
enum Framing {
    Length(usize),
    Chunked,
}

pub struct Conn {
    stream: TcpStream,
    buf: Vec<u8>,
    /// `buf[pos..filled]` is read and not yet consumed.
    pos: usize,
    filled: usize,
}

impl Conn {
    pub async fn connect(addr: SocketAddr) -> Result<Self> {
        let stream = TcpStream::connect(addr)
            .await
            .with_context(|| format!("connecting to {addr}"))?;
        stream.set_nodelay(true)?;
        Ok(Self {
            stream,
            buf: vec![0; 16 * 1024],
            pos: 0,
            filled: 0,
        })
    }

    pub async fn send(&mut self, request: &[u8]) -> Result<()> {
        self.stream
            .write_all(request)
            .await
            .context("writing a request")
    }

    /// Sends `request` and reads the whole answer.
    pub async fn exchange(&mut self, request: &[u8]) -> Result<Reply> {
        self.send(request).await?;
        self.read_reply().await
    }

    /// Reads one answer, keeping only its status (the load's path: no allocation).
    pub async fn read_status(&mut self) -> Result<u16> {
        let (status, framing, _) = self.read_head(false).await?;
        self.skip_body(framing, None).await?;
        Ok(status)
    }

    /// Reads one whole answer.
    pub async fn read_reply(&mut self) -> Result<Reply> {
        let (status, framing, headers) = self.read_head(true).await?;
        let mut body = Vec::new();
        self.skip_body(framing, Some(&mut body)).await?;
        Ok(Reply {
            status,
            headers,
            body,
        })
    }

    async fn read_head(&mut self, keep: bool) -> Result<(u16, Framing, Vec<(String, Vec<u8>)>)> {
        loop {
            let mut slots = [httparse::EMPTY_HEADER; 48];
            let mut response = httparse::Response::new(&mut slots);
            let parsed = response
                .parse(&self.buf[self.pos..self.filled])
                .context("parsing a response head")?;
            if let httparse::Status::Complete(len) = parsed {
                let status = response.code.unwrap_or(0);
                let mut framing = Framing::Length(0);
                let mut headers = Vec::new();
                for h in response.headers.iter() {
                    if h.name.eq_ignore_ascii_case("content-length") {
                        let n = std::str::from_utf8(h.value)
                            .ok()
                            .and_then(|v| v.trim().parse().ok())
                            .context("a bad content-length")?;
                        framing = Framing::Length(n);
                    } else if h.name.eq_ignore_ascii_case("transfer-encoding")
                        && h.value.eq_ignore_ascii_case(b"chunked")
                    {
                        framing = Framing::Chunked;
                    }
                    if keep {
                        headers.push((h.name.to_ascii_lowercase(), h.value.to_vec()));
                    }
                }
                self.pos += len;
                return Ok((status, framing, headers));
            }
            self.fill().await?;
        }
    }

    async fn skip_body(&mut self, framing: Framing, mut out: Option<&mut Vec<u8>>) -> Result<()> {
        match framing {
            Framing::Length(n) => self.take(n, out).await,
            Framing::Chunked => loop {
                let line = self.line().await?;
                let size = line.split(|&b| b == b';').next().unwrap_or_default();
                let size = std::str::from_utf8(size)
                    .ok()
                    .and_then(|s| usize::from_str_radix(s.trim(), 16).ok())
                    .context("a bad chunk size")?;
                if size == 0 {
                    // Trailers, up to the empty line.
                    while !self.line().await?.is_empty() {}
                    return Ok(());
                }
                self.take(size, out.as_deref_mut()).await?;
                if !self.line().await?.is_empty() {
                    bail!("a chunk not followed by CRLF");
                }
            },
        }
    }

    /// Consumes `n` bytes of body, copying them into `out` if given.
    async fn take(&mut self, mut n: usize, mut out: Option<&mut Vec<u8>>) -> Result<()> {
        while n > 0 {
            if self.pos == self.filled {
                self.fill().await?;
            }
            let here = n.min(self.filled - self.pos);
            if let Some(out) = out.as_deref_mut() {
                out.extend_from_slice(&self.buf[self.pos..self.pos + here]);
            }
            self.pos += here;
            n -= here;
        }
        Ok(())
    }

    /// Consumes one CRLF-terminated line and returns it without the CRLF.
    async fn line(&mut self) -> Result<Vec<u8>> {
        loop {
            let seen = &self.buf[self.pos..self.filled];
            if let Some(at) = seen.windows(2).position(|w| w == b"\r\n") {
                let line = seen[..at].to_vec();
                self.pos += at + 2;
                return Ok(line);
            }
            self.fill().await?;
        }
    }

    /// Reads more bytes from the socket.
    async fn fill(&mut self) -> Result<()> {
        if self.pos == self.filled {
            self.pos = 0;
            self.filled = 0;
        } else if self.pos > 0 {
            self.buf.copy_within(self.pos..self.filled, 0);
            self.filled -= self.pos;
            self.pos = 0;
        }
        if self.filled == self.buf.len() {
            let len = self.buf.len() * 2;
            self.buf.resize(len, 0);
        }
        let n = self
            .stream
            .read(&mut self.buf[self.filled..])
            .await
            .context("reading a response")?;
        if n == 0 {
            bail!("the server closed the connection");
        }
        self.filled += n;
        Ok(())
    }
}
