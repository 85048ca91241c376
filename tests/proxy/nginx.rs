//! Differential test against a backend known to normalise paths: nginx serving WebDAV.
//!
//! For each spelling of a path, nginx is asked directly which file it writes, and fencegate
//! must either refuse the spelling or fence it under exactly that file's path. `.ci/run`
//! installs nginx; where it is missing outside CI, the test says so and skips.

use crate::common;

use std::path::Path;

use common::nginx::start_nginx;
use common::{Harness, raw_request};

/// The file under `root` whose content is `body`, as a path from the root.
fn file_holding(root: &Path, body: &str) -> Option<String> {
    let mut stack = vec![root.to_path_buf()];
    while let Some(dir) = stack.pop() {
        for entry in std::fs::read_dir(&dir).ok()?.flatten() {
            let path = entry.path();
            if path.is_dir() {
                stack.push(path);
            } else if std::fs::read(&path).ok()? == body.as_bytes() {
                return Some(format!("/{}", path.strip_prefix(root).ok()?.display()));
            }
        }
    }
    None
}

fn percent_decode(s: &str) -> String {
    let b = s.as_bytes();
    let mut out = Vec::with_capacity(b.len());
    let mut i = 0;
    while i < b.len() {
        if b[i] == b'%'
            && let Some(v) = s.get(i + 1..i + 3).and_then(|h| u8::from_str_radix(h, 16).ok())
        {
            out.push(v);
            i += 3;
            continue;
        }
        out.push(b[i]);
        i += 1;
    }
    String::from_utf8_lossy(&out).into_owned()
}

#[tokio::test]
async fn every_spelling_nginx_resolves_to_a_file_is_refused_or_fenced_as_that_file() {
    let Some(nginx) = start_nginx().await else { return };
    let h = Harness::start_with(|c| c.backend.url = format!("http://{}", nginx.addr).parse().unwrap()).await;
    let spellings = [
        "/h/a/b.txt",
        "//h/a/b.txt",
        "/h//a///b.txt",
        "/h/a/./b.txt",
        "/h/./a/b.txt/.",
        "/h/a/x/../b.txt",
        "/h/x/y/../../a/b.txt",
        "/h/a/x/%2e%2e/b.txt",
        "/h/a/x/%2E%2E/b.txt",
        "/h/a/x/.%2e/b.txt",
        "/h/%61/b.txt",
        "/h/a/b%2Etxt",
        "/h/a/%62.txt",
        "/h/c!d.txt",
        "/h/c%21d.txt",
        "/h/e:f@g.txt",
        "/h/e%3Af%40g.txt",
        "/h/sp%20ace.txt",
        "/h/%7Euser/f.txt",
        "/h/~user/f.txt",
        "/h/a%2Fb.txt",
        "/h/a%2fb.txt",
        "/h/x%2F..%2Fa/b.txt",
        "/h/a%5Cb.txt",
        "/h/a/b.txt;x",
        "/h/a%3Bb.txt",
    ];
    let (mut fenced, mut refused) = (0, 0);
    let mut keys_of_file: std::collections::HashMap<String, std::collections::BTreeSet<String>> = Default::default();
    for (i, spelling) in spellings.iter().enumerate() {
        // What nginx itself makes of this spelling.
        let direct = format!("direct-{i}");
        let r = raw_request(nginx.addr, &format!("PUT {spelling} HTTP/1.1\r\nHost: x"), &direct).await;
        let nginx_file = if r.status < 300 { file_holding(&nginx.root, &direct) } else { None };

        // What fencegate makes of it.
        let token = 1000 + i as u64;
        let via = format!("via-{i}");
        let r = h.raw(&format!("PUT {spelling} HTTP/1.1\r\nHost: x\r\nFencing-Token: {token}"), &via).await;
        match r.fencegate_error() {
            Some("invalid_path") => refused += 1,
            None => {
                // Relayed: nginx must treat it exactly as it treats the spelling itself.
                let written = if r.status < 300 { file_holding(&nginx.root, &via) } else { None };
                assert_eq!(written, nginx_file, "{spelling}: nginx writes it as another file");
                if let Some(file) = written {
                    // The key fencegate fenced it under, from its own answer to a replay.
                    let again =
                        h.raw(&format!("PUT {spelling} HTTP/1.1\r\nHost: x\r\nFencing-Token: {token}"), "v").await;
                    again.assert_refused(409, "stale_token");
                    let key = again.json()["resource"].as_str().unwrap().to_owned();
                    // Keys are URI spellings (one canonical escape per character), files are not.
                    assert_eq!(percent_decode(&key), file, "{spelling}: fenced as {key}, nginx wrote {file}");
                    keys_of_file.entry(file).or_default().insert(key);
                    fenced += 1;
                }
            }
            Some(other) => panic!("{spelling}: unexpected {other}"),
        }
    }
    // Every spelling nginx maps to one file shares one fence key: no alias escapes the fence.
    for (file, keys) in &keys_of_file {
        assert_eq!(keys.len(), 1, "{file} is fenced under several keys: {keys:?}");
    }
    eprintln!("{fenced} spellings fenced as the file nginx writes ({} files), {refused} refused", keys_of_file.len());
    assert!(fenced >= 18 && refused >= 5, "{fenced} fenced, {refused} refused");
}

/// nginx answers a WebDAV PUT that creates a file with an absolute `Location` naming itself;
/// relayed unchanged, it would send the client to the backend around the fence.
#[tokio::test]
async fn the_backends_redirects_name_fencegate_not_the_backend() {
    let Some(nginx) = start_nginx().await else { return };
    let backend = format!("http://{}", nginx.addr);
    let h = Harness::start_with(|c| c.backend.url = backend.parse().unwrap()).await;
    let created = h.put("/loc/a", 1, "a").await;
    assert_eq!(created.status, 201, "{created:?}");
    let location = created.headers.get("location").expect("nginx names what it created");
    assert_eq!(location, &format!("http://{}/loc/a", h.addr), "rewritten to the address the client used");

    let kept = Harness::start_with(|c| {
        c.backend.url = backend.parse().unwrap();
        c.headers.rewrite_location = false;
    })
    .await;
    let created = kept.put("/loc/b", 1, "b").await;
    assert_eq!(created.headers.get("location").unwrap(), &format!("{backend}/loc/b"), "rewrite_location = false");
}
