//! A publisher that writes AMQP 0-9-1 frames itself, for messages no client library will send:
//! properties whose short strings are not UTF-8 (which RabbitMQ accepts and forwards as they
//! are). Plain TCP, PLAIN login, one publish per connection, closed cleanly (RabbitMQ has routed
//! the message once the close is answered).

use std::io::{Read, Write};
use std::net::TcpStream;
use std::time::Duration;

use crate::AmqpEndpoint;

fn short(v: &mut Vec<u8>, s: &[u8]) {
    v.push(u8::try_from(s.len()).expect("a short string"));
    v.extend_from_slice(s);
}

fn long(v: &mut Vec<u8>, s: &[u8]) {
    v.extend_from_slice(&u32::try_from(s.len()).expect("a long string").to_be_bytes());
    v.extend_from_slice(s);
}

fn method(class: u16, id: u16, args: &[u8]) -> Vec<u8> {
    let mut p = class.to_be_bytes().to_vec();
    p.extend_from_slice(&id.to_be_bytes());
    p.extend_from_slice(args);
    p
}

fn write_frame(s: &mut TcpStream, kind: u8, channel: u16, payload: &[u8]) -> std::io::Result<()> {
    let mut f = vec![kind];
    f.extend_from_slice(&channel.to_be_bytes());
    f.extend_from_slice(&(payload.len() as u32).to_be_bytes());
    f.extend_from_slice(payload);
    f.push(0xCE);
    s.write_all(&f)
}

/// Reads frames until a method frame of (class, id); returns its arguments.
fn expect(s: &mut TcpStream, class: u16, id: u16) -> Result<Vec<u8>, String> {
    loop {
        let mut head = [0u8; 7];
        s.read_exact(&mut head).map_err(|e| e.to_string())?;
        let size = u32::from_be_bytes([head[3], head[4], head[5], head[6]]) as usize;
        let mut rest = vec![0u8; size + 1];
        s.read_exact(&mut rest).map_err(|e| e.to_string())?;
        if head[0] == 1 && size >= 4 {
            let got = (
                u16::from_be_bytes([rest[0], rest[1]]),
                u16::from_be_bytes([rest[2], rest[3]]),
            );
            if got == (class, id) {
                return Ok(rest[4..size].to_vec());
            }
            if got == (10, 50) || got == (20, 40) {
                return Err(format!(
                    "closed by the broker: {}",
                    String::from_utf8_lossy(&rest[6..size])
                ));
            }
        }
    }
}

/// Publishes one persistent message to `exchange`/`routing_key` whose message_id is
/// `message_id`, byte for byte.
pub fn publish_with_message_id(
    ep: &AmqpEndpoint,
    exchange: &str,
    routing_key: &str,
    message_id: &[u8],
    body: &[u8],
) -> Result<(), String> {
    let mut s = TcpStream::connect((ep.host.as_str(), ep.port)).map_err(|e| e.to_string())?;
    s.set_read_timeout(Some(Duration::from_secs(10)))
        .map_err(|e| e.to_string())?;
    s.write_all(b"AMQP\x00\x00\x09\x01")
        .map_err(|e| e.to_string())?;
    expect(&mut s, 10, 10)?; // start
    let mut a = Vec::new();
    a.extend_from_slice(&0u32.to_be_bytes()); // client properties
    short(&mut a, b"PLAIN");
    long(
        &mut a,
        format!("\0{}\0{}", ep.username, ep.password).as_bytes(),
    );
    short(&mut a, b"en_US");
    let io = |e: std::io::Error| e.to_string();
    write_frame(&mut s, 1, 0, &method(10, 11, &a)).map_err(io)?;
    expect(&mut s, 10, 30)?; // tune
    let mut a = Vec::new();
    a.extend_from_slice(&1u16.to_be_bytes());
    a.extend_from_slice(&131_072u32.to_be_bytes());
    a.extend_from_slice(&0u16.to_be_bytes());
    write_frame(&mut s, 1, 0, &method(10, 31, &a)).map_err(io)?;
    let mut a = Vec::new();
    short(&mut a, ep.vhost.as_bytes());
    short(&mut a, b"");
    a.push(0);
    write_frame(&mut s, 1, 0, &method(10, 40, &a)).map_err(io)?;
    expect(&mut s, 10, 41)?;
    write_frame(&mut s, 1, 1, &method(20, 10, &[0])).map_err(io)?;
    expect(&mut s, 20, 11)?;
    let mut a = 0u16.to_be_bytes().to_vec();
    short(&mut a, exchange.as_bytes());
    short(&mut a, routing_key.as_bytes());
    a.push(0);
    write_frame(&mut s, 1, 1, &method(60, 40, &a)).map_err(io)?;
    let mut h = Vec::new();
    h.extend_from_slice(&60u16.to_be_bytes());
    h.extend_from_slice(&0u16.to_be_bytes());
    h.extend_from_slice(&(body.len() as u64).to_be_bytes());
    h.extend_from_slice(&((1u16 << 12) | (1u16 << 7)).to_be_bytes());
    h.push(2); // persistent
    short(&mut h, message_id);
    write_frame(&mut s, 2, 1, &h).map_err(io)?;
    write_frame(&mut s, 3, 1, body).map_err(io)?;
    let mut a = 200u16.to_be_bytes().to_vec();
    short(&mut a, b"done");
    a.extend_from_slice(&[0, 0, 0, 0]);
    write_frame(&mut s, 1, 0, &method(10, 50, &a)).map_err(io)?;
    expect(&mut s, 10, 51).map(|_| ())
}
