//! A TCP relay on loopback that records the bytes its clients send: put between fencegate and
//! an S3 server, it shows what the server received (an aws-chunked body, its trailer, which
//! headers), as a packet dump would, without root.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// A relay to one address; what each connection sent, in order of arrival, is kept until the
/// tap is dropped (when it stops accepting).
pub struct Tap {
    pub addr: SocketAddr,
    sent: Arc<Mutex<Vec<Vec<u8>>>>,
    accept: JoinHandle<()>,
}

impl Tap {
    /// Relays every connection to `target`.
    pub async fn start(target: SocketAddr) -> Tap {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let sent: Arc<Mutex<Vec<Vec<u8>>>> = Arc::default();
        let record = Arc::clone(&sent);
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(target).await else { continue };
                let slot = {
                    let mut sent = record.lock().unwrap();
                    sent.push(Vec::new());
                    sent.len() - 1
                };
                tokio::spawn(relay(client, server, Arc::clone(&record), slot));
            }
        });
        Tap { addr, sent, accept }
    }

    pub fn url(&self) -> String {
        format!("http://{}", self.addr)
    }

    /// Everything clients sent so far, one entry per connection.
    pub fn sent(&self) -> Vec<Vec<u8>> {
        self.sent.lock().unwrap().clone()
    }

    /// Everything clients sent so far, as one lossy string (headers are ASCII).
    pub fn text(&self) -> String {
        self.sent().iter().map(|c| String::from_utf8_lossy(c).into_owned()).collect::<Vec<_>>().join("\n")
    }
}

impl Drop for Tap {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// Copies both ways until either side closes, recording what `client` sent.
async fn relay(client: TcpStream, server: TcpStream, sent: Arc<Mutex<Vec<Vec<u8>>>>, slot: usize) {
    let (mut client_read, mut client_write) = client.into_split();
    let (mut server_read, mut server_write) = server.into_split();
    let upstream = async move {
        let mut buf = vec![0u8; 64 << 10];
        loop {
            let n = match client_read.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            sent.lock().unwrap()[slot].extend_from_slice(&buf[..n]);
            if server_write.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        let _ = server_write.shutdown().await;
    };
    let downstream = async move {
        let _ = tokio::io::copy(&mut server_read, &mut client_write).await;
        let _ = client_write.shutdown().await;
    };
    tokio::join!(upstream, downstream);
}
