//! A TCP relay on loopback that records the bytes its clients send and the server answers: put
//! between fencegate and an S3 server, it shows what the server received (an aws-chunked body,
//! its trailer, which headers) and what it said, as a packet dump would, without root.

use std::net::SocketAddr;
use std::sync::{Arc, Mutex};

use tokio::io::{AsyncReadExt, AsyncWriteExt};
use tokio::net::{TcpListener, TcpStream};
use tokio::task::JoinHandle;

/// A relay to one address; what each connection sent and was answered, in order of arrival,
/// is kept until the tap is dropped (when it stops accepting).
pub struct Tap {
    pub addr: SocketAddr,
    sent: Arc<Mutex<Vec<Vec<u8>>>>,
    answered: Arc<Mutex<Vec<Vec<u8>>>>,
    accept: JoinHandle<()>,
}

impl Tap {
    /// Relays every connection to `target`.
    pub async fn start(target: SocketAddr) -> Tap {
        let listener = TcpListener::bind("127.0.0.1:0").await.unwrap();
        let addr = listener.local_addr().unwrap();
        let sent: Arc<Mutex<Vec<Vec<u8>>>> = Arc::default();
        let answered: Arc<Mutex<Vec<Vec<u8>>>> = Arc::default();
        let (record, record_answers) = (Arc::clone(&sent), Arc::clone(&answered));
        let accept = tokio::spawn(async move {
            while let Ok((client, _)) = listener.accept().await {
                let Ok(server) = TcpStream::connect(target).await else { continue };
                let slot = {
                    let mut sent = record.lock().unwrap();
                    sent.push(Vec::new());
                    record_answers.lock().unwrap().push(Vec::new());
                    sent.len() - 1
                };
                let records = (Arc::clone(&record), Arc::clone(&record_answers));
                tokio::spawn(relay(client, server, records, slot));
            }
        });
        Tap { addr, sent, answered, accept }
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

    /// Everything the server answered so far, as one lossy string.
    pub fn answers(&self) -> String {
        let answered = self.answered.lock().unwrap();
        answered.iter().map(|c| String::from_utf8_lossy(c).into_owned()).collect::<Vec<_>>().join("\n")
    }
}

impl Drop for Tap {
    fn drop(&mut self) {
        self.accept.abort();
    }
}

/// What the clients sent and what they were answered, one entry per connection.
type Records = (Arc<Mutex<Vec<Vec<u8>>>>, Arc<Mutex<Vec<Vec<u8>>>>);

/// Copies both ways until either side closes, recording what `client` sent and `server`
/// answered.
async fn relay(client: TcpStream, server: TcpStream, (sent, answered): Records, slot: usize) {
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
        let mut buf = vec![0u8; 64 << 10];
        loop {
            let n = match server_read.read(&mut buf).await {
                Ok(0) | Err(_) => break,
                Ok(n) => n,
            };
            answered.lock().unwrap()[slot].extend_from_slice(&buf[..n]);
            if client_write.write_all(&buf[..n]).await.is_err() {
                break;
            }
        }
        let _ = client_write.shutdown().await;
    };
    tokio::join!(upstream, downstream);
}
