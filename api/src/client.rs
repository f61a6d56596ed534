//! A small blocking HTTP/1.1 client over a Unix socket, for `lendctl` and tests.
//!
//! One request per connection (`Connection: close`), read and write timeouts, bodies read by
//! `Content-Length`, chunked encoding or EOF. That is all the API server needs, and it keeps
//! `lendctl` free of an async runtime.

use std::io::{self, Read, Write};
use std::os::unix::net::UnixStream;
use std::path::{Path, PathBuf};
use std::time::Duration;

use serde::de::DeserializeOwned;
use serde::Serialize;
use thiserror::Error;

use crate::events::VmEvent;
use crate::server::API_ROOT;
use crate::types::VmCountersReport;
use crate::types::{
    PciDeviceInfo, VmAddRemoteDeviceData, VmInfo, VmReceiveMigrationData, VmRemoveDeviceData,
    VmSendMigrationData, VmSnapshotConfig, VmmPingResponse,
};

/// Responses larger than this are refused (the API's are a few KiB).
const MAX_RESPONSE: usize = 16 * 1024 * 1024;

/// Errors talking to the API server.
#[derive(Debug, Error)]
pub enum ClientError {
    #[error("cannot connect to api socket {0}: {1}")]
    Connect(PathBuf, io::Error),
    #[error("i/o error on api socket {0}: {1}")]
    Io(PathBuf, io::Error),
    #[error("malformed http response: {0}")]
    BadResponse(String),
    #[error("response larger than {MAX_RESPONSE} bytes")]
    TooLarge,
    /// The server answered with a non-2xx status; `message` is its plain-text body.
    #[error("{status} {reason}: {message}")]
    Status {
        status: u16,
        reason: String,
        message: String,
    },
    #[error("cannot decode the {0} response: {1}")]
    Decode(&'static str, serde_json::Error),
    #[error("cannot encode the request: {0}")]
    Encode(serde_json::Error),
}

/// A raw HTTP response.
#[derive(Debug, Clone)]
pub struct HttpResponse {
    pub status: u16,
    pub reason: String,
    /// Header names lower-cased.
    pub headers: Vec<(String, String)>,
    pub body: Vec<u8>,
}

impl HttpResponse {
    pub fn header(&self, name: &str) -> Option<&str> {
        let name = name.to_ascii_lowercase();
        self.headers
            .iter()
            .find(|(n, _)| *n == name)
            .map(|(_, v)| v.as_str())
    }

    pub fn body_text(&self) -> String {
        String::from_utf8_lossy(&self.body).into_owned()
    }

    /// `Ok(self)` for 2xx, else [`ClientError::Status`] carrying the body as the message.
    pub fn ok(self) -> Result<HttpResponse, ClientError> {
        if (200..300).contains(&self.status) {
            Ok(self)
        } else {
            Err(ClientError::Status {
                status: self.status,
                message: self.body_text().trim().to_string(),
                reason: self.reason,
            })
        }
    }
}

/// Client for one API socket.
#[derive(Debug, Clone)]
pub struct ApiClient {
    socket: PathBuf,
    timeout: Duration,
}

fn find(hay: &[u8], needle: &[u8]) -> Option<usize> {
    hay.windows(needle.len()).position(|w| w == needle)
}

fn bad(msg: impl Into<String>) -> ClientError {
    ClientError::BadResponse(msg.into())
}

fn decode_chunked(mut data: &[u8]) -> Result<Vec<u8>, ClientError> {
    let mut out = Vec::new();
    loop {
        let line_end = find(data, b"\r\n").ok_or_else(|| bad("truncated chunk size"))?;
        let size_str = std::str::from_utf8(&data[..line_end]).map_err(|_| bad("chunk size"))?;
        let size_str = size_str.split(';').next().unwrap_or("").trim();
        let size = usize::from_str_radix(size_str, 16)
            .map_err(|_| bad(format!("bad chunk size {size_str:?}")))?;
        data = &data[line_end + 2..];
        if size == 0 {
            return Ok(out);
        }
        if data.len() < size + 2 {
            return Err(bad("truncated chunk"));
        }
        out.extend_from_slice(&data[..size]);
        data = &data[size + 2..];
    }
}

/// Parses a complete response (the connection was read to EOF).
pub fn parse_response(raw: &[u8]) -> Result<HttpResponse, ClientError> {
    let (mut resp, head_end) = parse_head(raw)?;
    let rest = &raw[head_end + 4..];
    resp.body = if resp
        .header("transfer-encoding")
        .is_some_and(|v| v.eq_ignore_ascii_case("chunked"))
    {
        decode_chunked(rest)?
    } else if let Some(len) = resp.header("content-length") {
        let len: usize = len
            .parse()
            .map_err(|_| bad(format!("bad content-length {len:?}")))?;
        if rest.len() < len {
            return Err(bad(format!(
                "body truncated: {} of {len} bytes",
                rest.len()
            )));
        }
        rest[..len].to_vec()
    } else {
        rest.to_vec()
    };
    Ok(resp)
}

/// Parses the status line and headers; returns them (no body) and where the head ends.
fn parse_head(raw: &[u8]) -> Result<(HttpResponse, usize), ClientError> {
    let head_end = find(raw, b"\r\n\r\n").ok_or_else(|| bad("no end of headers"))?;
    let head = std::str::from_utf8(&raw[..head_end]).map_err(|_| bad("headers are not utf-8"))?;
    let mut lines = head.split("\r\n");
    let status_line = lines.next().unwrap_or("");
    let mut parts = status_line.splitn(3, ' ');
    let version = parts.next().unwrap_or("");
    if !version.starts_with("HTTP/1.") {
        return Err(bad(format!("bad status line {status_line:?}")));
    }
    let status: u16 = parts
        .next()
        .and_then(|s| s.parse().ok())
        .ok_or_else(|| bad(format!("bad status line {status_line:?}")))?;
    let reason = parts.next().unwrap_or("").to_string();
    let mut headers = Vec::new();
    for line in lines {
        let (n, v) = line
            .split_once(':')
            .ok_or_else(|| bad(format!("bad header line {line:?}")))?;
        headers.push((n.trim().to_ascii_lowercase(), v.trim().to_string()));
    }
    let resp = HttpResponse {
        status,
        reason,
        headers,
        body: Vec::new(),
    };
    Ok((resp, head_end))
}

impl ApiClient {
    /// `timeout` bounds each read and write on the socket.
    pub fn new(socket: impl Into<PathBuf>, timeout: Duration) -> Self {
        ApiClient {
            socket: socket.into(),
            timeout,
        }
    }

    pub fn socket(&self) -> &Path {
        &self.socket
    }

    /// Sends `method /api/v1/<endpoint>` with an optional JSON body and returns the raw response.
    pub fn request(
        &self,
        method: &str,
        endpoint: &str,
        body: Option<&[u8]>,
    ) -> Result<HttpResponse, ClientError> {
        let io_err = |e| ClientError::Io(self.socket.clone(), e);
        let mut stream = UnixStream::connect(&self.socket)
            .map_err(|e| ClientError::Connect(self.socket.clone(), e))?;
        stream
            .set_read_timeout(Some(self.timeout))
            .map_err(io_err)?;
        stream
            .set_write_timeout(Some(self.timeout))
            .map_err(io_err)?;
        let mut req = format!(
            "{method} {API_ROOT}/{endpoint} HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\nConnection: close\r\n"
        )
        .into_bytes();
        if let Some(body) = body {
            req.extend_from_slice(
                format!(
                    "Content-Type: application/json\r\nContent-Length: {}\r\n\r\n",
                    body.len()
                )
                .as_bytes(),
            );
            req.extend_from_slice(body);
        } else if method == "PUT" {
            req.extend_from_slice(b"Content-Length: 0\r\n\r\n");
        } else {
            req.extend_from_slice(b"\r\n");
        }
        // A server that rejects a large body early may close before reading it all; its
        // response is still readable, so a failed write is only fatal if nothing comes back.
        let write_result = stream.write_all(&req);
        let mut raw = Vec::new();
        let mut buf = [0u8; 8192];
        loop {
            match stream.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => {
                    raw.extend_from_slice(&buf[..n]);
                    if raw.len() > MAX_RESPONSE {
                        return Err(ClientError::TooLarge);
                    }
                }
                Err(e) if e.kind() == io::ErrorKind::Interrupted => {}
                Err(e) if e.kind() == io::ErrorKind::ConnectionReset && !raw.is_empty() => break,
                Err(e) => {
                    return Err(io_err(match write_result {
                        Err(we) => we,
                        Ok(()) => e,
                    }))
                }
            }
        }
        if raw.is_empty() {
            if let Err(e) = write_result {
                return Err(io_err(e));
            }
            return Err(bad("connection closed without a response"));
        }
        parse_response(&raw)
    }

    fn call<T: DeserializeOwned>(
        &self,
        method: &str,
        endpoint: &'static str,
        body: Option<&[u8]>,
    ) -> Result<T, ClientError> {
        let resp = self.request(method, endpoint, body)?.ok()?;
        serde_json::from_slice(&resp.body).map_err(|e| ClientError::Decode(endpoint, e))
    }

    fn put_json<B: Serialize>(
        &self,
        endpoint: &'static str,
        body: &B,
    ) -> Result<HttpResponse, ClientError> {
        let body = serde_json::to_vec(body).map_err(ClientError::Encode)?;
        self.request("PUT", endpoint, Some(&body))?.ok()
    }

    pub fn ping(&self) -> Result<VmmPingResponse, ClientError> {
        self.call("GET", "vmm.ping", None)
    }

    pub fn info(&self) -> Result<VmInfo, ClientError> {
        self.call("GET", "vm.info", None)
    }

    pub fn add_remote_device(
        &self,
        data: &VmAddRemoteDeviceData,
    ) -> Result<PciDeviceInfo, ClientError> {
        let resp = self.put_json("vm.add-remote-device", data)?;
        serde_json::from_slice(&resp.body)
            .map_err(|e| ClientError::Decode("vm.add-remote-device", e))
    }

    pub fn remove_device(&self, data: &VmRemoveDeviceData) -> Result<(), ClientError> {
        self.put_json("vm.remove-device", data).map(|_| ())
    }

    pub fn shutdown(&self) -> Result<(), ClientError> {
        self.request("PUT", "vm.shutdown", None)?.ok().map(|_| ())
    }

    /// `vmm.shutdown`: tear the VM down and end the VMM process.
    pub fn vmm_shutdown(&self) -> Result<(), ClientError> {
        self.request("PUT", "vmm.shutdown", None)?.ok().map(|_| ())
    }

    pub fn pause(&self) -> Result<(), ClientError> {
        self.request("PUT", "vm.pause", None)?.ok().map(|_| ())
    }

    /// `vm.snapshot`: write a snapshot of the VM to `destination_url`.
    pub fn snapshot(&self, data: &VmSnapshotConfig) -> Result<(), ClientError> {
        self.put_json("vm.snapshot", data).map(|_| ())
    }

    /// `vm.send-migration`: live-migrate the VM to the VMM listening at `destination_url`;
    /// answers when the destination has taken the VM over (the source then exits).
    pub fn send_migration(&self, data: &VmSendMigrationData) -> Result<(), ClientError> {
        self.put_json("vm.send-migration", data).map(|_| ())
    }

    /// `vm.receive-migration`: listen at `receiver_url` for a migrating VM; answers once
    /// listening.
    pub fn receive_migration(&self, data: &VmReceiveMigrationData) -> Result<(), ClientError> {
        self.put_json("vm.receive-migration", data).map(|_| ())
    }

    pub fn resume(&self) -> Result<(), ClientError> {
        self.request("PUT", "vm.resume", None)?.ok().map(|_| ())
    }

    pub fn counters(&self) -> Result<VmCountersReport, ClientError> {
        self.call("GET", "vm.counters", None)
    }

    /// The retained events after `since` (0: all retained), without following.
    pub fn events(&self, since: u64) -> Result<Vec<VmEvent>, ClientError> {
        let resp = self
            .request(
                "GET",
                &format!("vm.events?since={since}&follow=false"),
                None,
            )?
            .ok()?;
        resp.body
            .split(|b| *b == b'\n')
            .filter(|l| !l.is_empty())
            .map(|l| serde_json::from_slice(l).map_err(|e| ClientError::Decode("vm.events", e)))
            .collect()
    }

    /// Follows `vm.events` (from `since` when given), calling `on_line` with every JSON line
    /// as it arrives, until the VMM ends the stream (`Ok`), `on_line` returns `false`, or the
    /// connection fails. The read timeout does not apply: the stream may be idle for long.
    pub fn follow_events(
        &self,
        since: Option<u64>,
        mut on_line: impl FnMut(&str) -> bool,
    ) -> Result<(), ClientError> {
        let io_err = |e| ClientError::Io(self.socket.clone(), e);
        let mut stream = UnixStream::connect(&self.socket)
            .map_err(|e| ClientError::Connect(self.socket.clone(), e))?;
        stream
            .set_write_timeout(Some(self.timeout))
            .map_err(io_err)?;
        let query = since.map(|s| format!("?since={s}")).unwrap_or_default();
        let req = format!(
            "GET {API_ROOT}/vm.events{query} HTTP/1.1\r\nHost: localhost\r\nAccept: */*\r\nConnection: close\r\n\r\n"
        );
        stream.write_all(req.as_bytes()).map_err(io_err)?;
        let mut raw = Vec::new();
        let mut buf = [0u8; 8192];
        let mut head: Option<HttpResponse> = None;
        let mut body = ChunkDecoder::default();
        let mut text = Vec::new();
        loop {
            let n = match stream.read(&mut buf) {
                Ok(0) => break,
                Ok(n) => n,
                Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
                Err(e) => return Err(io_err(e)),
            };
            raw.extend_from_slice(&buf[..n]);
            if head.is_none() {
                let Some(end) = find(&raw, b"\r\n\r\n") else {
                    if raw.len() > MAX_RESPONSE {
                        return Err(ClientError::TooLarge);
                    }
                    continue;
                };
                let (resp, _) = parse_head(&raw)?;
                if resp.status != 200 {
                    // An error answer is small and complete: read it whole.
                    stream.read_to_end(&mut raw).map_err(io_err)?;
                    return parse_response(&raw)?.ok().map(|_| ());
                }
                raw.drain(..end + 4);
                head = Some(resp);
            }
            body.feed(&raw, &mut text)?;
            raw.clear();
            while let Some(pos) = text.iter().position(|b| *b == b'\n') {
                let line: Vec<u8> = text.drain(..=pos).collect();
                let line = String::from_utf8_lossy(&line[..line.len() - 1]).into_owned();
                if !line.is_empty() && !on_line(&line) {
                    return Ok(());
                }
            }
            if body.done {
                break;
            }
        }
        if head.is_none() {
            return Err(bad("connection closed without a response"));
        }
        Ok(())
    }
}

/// Incremental `Transfer-Encoding: chunked` decoder for a stream that never ends on its own.
#[derive(Default)]
struct ChunkDecoder {
    pending: Vec<u8>,
    /// Bytes left of the current chunk's data (+ its CRLF).
    left: usize,
    done: bool,
}

impl ChunkDecoder {
    fn feed(&mut self, data: &[u8], out: &mut Vec<u8>) -> Result<(), ClientError> {
        self.pending.extend_from_slice(data);
        let mut at = 0;
        while !self.done && at < self.pending.len() {
            if self.left > 0 {
                let take = self.left.min(self.pending.len() - at);
                // The last two bytes of each chunk are its CRLF, not data.
                let data_left = self.left.saturating_sub(2);
                out.extend_from_slice(&self.pending[at..at + take.min(data_left)]);
                self.left -= take;
                at += take;
                continue;
            }
            let Some(end) = find(&self.pending[at..], b"\r\n") else {
                break;
            };
            let size_str =
                std::str::from_utf8(&self.pending[at..at + end]).map_err(|_| bad("chunk size"))?;
            let size_str = size_str.split(';').next().unwrap_or("").trim();
            let size = usize::from_str_radix(size_str, 16)
                .map_err(|_| bad(format!("bad chunk size {size_str:?}")))?;
            at += end + 2;
            if size == 0 {
                self.done = true;
            } else {
                self.left = size + 2;
            }
        }
        self.pending.drain(..at);
        if self.pending.len() > MAX_RESPONSE {
            return Err(ClientError::TooLarge);
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_content_length_and_chunked() {
        let r = parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: 2\r\nX: y\r\n\r\n{}").unwrap();
        assert_eq!((r.status, r.body.as_slice()), (200, &b"{}"[..]));
        assert_eq!(r.header("x"), Some("y"));
        let r = parse_response(
            b"HTTP/1.1 200 OK\r\nTransfer-Encoding: chunked\r\n\r\n3\r\nabc\r\n2\r\nde\r\n0\r\n\r\n",
        )
        .unwrap();
        assert_eq!(r.body, b"abcde");
        let r = parse_response(b"HTTP/1.1 204 No Content\r\n\r\n").unwrap();
        assert_eq!((r.status, r.body.len()), (204, 0));
        assert!(parse_response(b"garbage").is_err());
        assert!(parse_response(b"HTTP/1.1 200 OK\r\nContent-Length: 5\r\n\r\nab").is_err());
    }

    #[test]
    fn non_2xx_becomes_status_error() {
        let r =
            parse_response(b"HTTP/1.1 404 Not Found\r\nContent-Length: 12\r\n\r\nno device x\n")
                .unwrap();
        match r.ok() {
            Err(ClientError::Status {
                status, message, ..
            }) => assert_eq!((status, message.as_str()), (404, "no device x")),
            other => panic!("{other:?}"),
        }
    }
}
