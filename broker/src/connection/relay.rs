//! A consumer connection's bytes from the broker pass through [`Scanner`] before lapin reads
//! them. lapin takes its socket from a connect function and reads it itself, so the connection
//! to the broker (plain or TLS, as configured) is made here, and lapin gets the other end of a
//! loopback TCP pair; two tasks copy between them, the broker's side sanitized. The pair's
//! listener lives for one accept, and the accepted end must echo a random token first: no other
//! local process can take lapin's place.

use super::sanitize::Scanner;
use futures_util::io::{AsyncRead, AsyncReadExt as _, AsyncWrite, AsyncWriteExt as _};
use lapin::tcp::AsyncTcpStream;
use lapin::uri::{AMQPScheme, AMQPUri};
use rand::RngCore;
use std::io;
use std::time::Duration;
use tokio::io::{AsyncReadExt, AsyncWriteExt};

/// Bound on making the loopback pair.
const PAIR_WAIT: Duration = Duration::from_secs(5);
const BUFFER: usize = 64 * 1024;

/// Returns the stream for lapin: the loopback end whose reads are `real`'s, sanitized.
/// `loopback` opens a plain connection to an address (lapin's runtime's own connect).
pub(crate) async fn sanitized<S, F, Fut>(
    real: AsyncTcpStream<S>,
    loopback: F,
) -> io::Result<AsyncTcpStream<S>>
where
    S: AsyncRead + AsyncWrite + Send + Unpin + 'static,
    F: FnOnce(AMQPUri) -> Fut,
    Fut: std::future::Future<Output = io::Result<AsyncTcpStream<S>>>,
{
    let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0)).await?;
    let port = listener.local_addr()?.port();
    let mut uri = AMQPUri {
        scheme: AMQPScheme::AMQP,
        ..AMQPUri::default()
    };
    uri.authority.host = "127.0.0.1".to_string();
    uri.authority.port = port;
    let pair = async {
        let (ours, accepted) = tokio::join!(loopback(uri), listener.accept());
        let (mut ours, (mut accepted, _)) = (ours?, accepted?);
        let mut token = [0u8; 16];
        rand::thread_rng().fill_bytes(&mut token);
        ours.write_all(&token).await?;
        let mut echo = [0u8; 16];
        accepted.read_exact(&mut echo).await?;
        if echo != token {
            return Err(io::Error::new(
                io::ErrorKind::PermissionDenied,
                "another process connected to the consumer's loopback relay",
            ));
        }
        Ok::<_, io::Error>((ours, accepted))
    };
    let (ours, accepted) = tokio::time::timeout(PAIR_WAIT, pair).await.map_err(|_| {
        io::Error::new(io::ErrorKind::TimedOut, "loopback relay not made in time")
    })??;
    drop(listener);
    let (mut from_broker, mut to_broker) = real.split();
    let (mut from_lapin, mut to_lapin) = towards_lapin(accepted)?.into_split();
    tokio::spawn(async move {
        let mut buf = vec![0u8; BUFFER];
        while let Ok(n) = from_lapin.read(&mut buf).await {
            if n == 0 || to_broker.write_all(&buf[..n]).await.is_err() {
                break;
            }
            if to_broker.flush().await.is_err() {
                break;
            }
        }
        let _ = to_broker.close().await;
    });
    tokio::spawn(async move {
        let mut buf = vec![0u8; BUFFER];
        let mut scanner = Scanner::default();
        while let Ok(n) = from_broker.read(&mut buf).await {
            if n == 0 {
                break;
            }
            let out = scanner.push(&buf[..n]);
            if to_lapin.write_all(&out).await.is_err() {
                break;
            }
        }
        let _ = to_lapin.shutdown().await;
    });
    Ok(ours)
}

/// lapin's end of the pair, which the copying task writes the broker's bytes to: each write
/// leaves at once. With Nagle's algorithm on, a delivery written right after a frame lapin does
/// not answer (the `queue.declare-ok` of the depth report, every 3 s) waited for that frame's
/// delayed ACK, 40 ms, and every subscription's handler with it.
fn towards_lapin(accepted: tokio::net::TcpStream) -> io::Result<tokio::net::TcpStream> {
    accepted.set_nodelay(true)?;
    Ok(accepted)
}

#[cfg(test)]
mod tests {
    use super::towards_lapin;

    #[tokio::test]
    async fn the_end_towards_lapin_sends_each_write_at_once() {
        let listener = tokio::net::TcpListener::bind(("127.0.0.1", 0))
            .await
            .unwrap();
        let addr = listener.local_addr().unwrap();
        let (client, accepted) =
            tokio::join!(tokio::net::TcpStream::connect(addr), listener.accept());
        let _client = client.unwrap();
        let (accepted, _) = accepted.unwrap();
        // An accepted socket starts with Nagle's algorithm on.
        assert!(!accepted.nodelay().unwrap());
        assert!(towards_lapin(accepted).unwrap().nodelay().unwrap());
    }
}
