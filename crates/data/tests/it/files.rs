//! `.bin`, `.npy` and shard readers, with files written here by hand.

use std::path::Path;

use data::{read_bin, read_npy, read_shard, write_bin, write_shard, Tokens};

use crate::{assert_names, temp_dir};

fn npy_bytes(descr: &str, shape: &str, data: &[u8], version: u8) -> Vec<u8> {
    let dict = format!("{{'descr': '{descr}', 'fortran_order': False, 'shape': {shape}, }}");
    let pre = if version == 1 { 10 } else { 12 };
    let mut header = dict.into_bytes();
    while (pre + header.len() + 1) % 64 != 0 {
        header.push(b' ');
    }
    header.push(b'\n');
    let mut out = b"\x93NUMPY".to_vec();
    out.push(version);
    out.push(0);
    if version == 1 {
        out.extend_from_slice(&(header.len() as u16).to_le_bytes());
    } else {
        out.extend_from_slice(&(header.len() as u32).to_le_bytes());
    }
    out.extend_from_slice(&header);
    out.extend_from_slice(data);
    out
}

fn le<T: Copy, const N: usize>(v: &[T], f: impl Fn(T) -> [u8; N]) -> Vec<u8> {
    v.iter().flat_map(|&x| f(x)).collect()
}

#[test]
fn bin_reads_u16_by_map() {
    let dir = temp_dir("bin");
    let p = dir.join("train.bin");
    let ids = [0u16, 1, 65535, 50256, 7];
    std::fs::write(&p, le(&ids, u16::to_le_bytes)).unwrap();
    let t = read_bin(&p).unwrap();
    assert!(t.is_mapped());
    assert_eq!(t.to_vec(), vec![0, 1, 65535, 50256, 7]);
    assert_eq!(t.get(3), 50256);
    let mut out = [0u32; 2];
    t.copy_to(2, &mut out);
    assert_eq!(out, [65535, 50256]);
    // Paired writer.
    let q = dir.join("copy.bin");
    write_bin(&q, &t.to_vec()).unwrap();
    assert_eq!(std::fs::read(&p).unwrap(), std::fs::read(&q).unwrap());
    assert_names(write_bin(&q, &[70000]).unwrap_err(), q.to_str().unwrap());
    // Odd size and empty file.
    std::fs::write(&p, [1u8, 2, 3]).unwrap();
    let msg = assert_names(read_bin(&p).unwrap_err(), p.to_str().unwrap());
    assert!(msg.contains("odd"), "{msg}");
    std::fs::write(&p, []).unwrap();
    assert_names(read_bin(&p).unwrap_err(), p.to_str().unwrap());
}

#[test]
fn npy_reads_every_supported_dtype() {
    let dir = temp_dir("npy");
    let ids: Vec<u32> = vec![3, 0, 65535, 70000, 12];
    let cases: Vec<(&str, Vec<u8>)> = vec![
        ("<u4", le(&ids, u32::to_le_bytes)),
        ("<i4", le(&ids.iter().map(|&x| x as i32).collect::<Vec<_>>(), i32::to_le_bytes)),
        ("<i8", le(&ids.iter().map(|&x| x as i64).collect::<Vec<_>>(), i64::to_le_bytes)),
        ("<u8", le(&ids.iter().map(|&x| x as u64).collect::<Vec<_>>(), u64::to_le_bytes)),
    ];
    for (version, (descr, bytes)) in [1u8, 2, 1, 3].into_iter().zip(cases) {
        let p = dir.join(format!("{}.npy", &descr[1..]));
        std::fs::write(&p, npy_bytes(descr, "(5,)", &bytes, version)).unwrap();
        let t = read_npy(&p).unwrap_or_else(|e| panic!("{descr}: {e}"));
        assert_eq!(t.to_vec(), ids, "{descr}");
    }
    let p = dir.join("u2.npy");
    std::fs::write(&p, npy_bytes("<u2", "(3,)", &le(&[1u16, 2, 65535], u16::to_le_bytes), 1)).unwrap();
    let t = read_npy(&p).unwrap();
    assert!(t.is_mapped());
    assert_eq!(t.to_vec(), vec![1, 2, 65535]);
}

#[test]
fn npy_rejects_bad_files_naming_them() {
    let dir = temp_dir("npybad");
    let p = dir.join("bad.npy");
    let name = p.to_str().unwrap();
    let four = le(&[1u32, 2, 3, 4], u32::to_le_bytes);
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (b"not numpy at all".to_vec(), "magic"),
        (npy_bytes("<f4", "(4,)", &four, 1), "'<f4'"),
        (npy_bytes(">u4", "(4,)", &four, 1), "'>u4'"),
        (npy_bytes("<u4", "(2, 2)", &four, 1), "1-D"),
        (npy_bytes("<u4", "(5,)", &four, 1), "truncated"),
        (npy_bytes("<u4", "(0,)", &[], 1), "empty"),
        (npy_bytes("<i4", "(1,)", &(-5i32).to_le_bytes(), 1), "-5"),
        (npy_bytes("<i8", "(1,)", &(1i64 << 40).to_le_bytes(), 1), "index 0"),
        (npy_bytes("<u4", "(4,)", &four, 1).into_iter().take(40).collect(), "header"),
    ];
    for (bytes, needle) in cases {
        std::fs::write(&p, &bytes).unwrap();
        let msg = assert_names(read_npy(&p).unwrap_err(), name);
        assert!(msg.contains(needle), "expected {needle:?} in {msg:?}");
    }
    let mut f = npy_bytes("<u4", "(4,)", &four, 1);
    let at = f.windows(5).position(|w| w == b"False").unwrap();
    f[at..at + 5].copy_from_slice(b"True ");
    std::fs::write(&p, &f).unwrap();
    let msg = assert_names(read_npy(&p).unwrap_err(), name);
    assert!(msg.contains("fortran"), "{msg}");
}

fn shard_header(width: u32, count: u64, vocab: u32) -> Vec<u8> {
    let mut h = b"KILNTOK\0".to_vec();
    h.extend_from_slice(&1u32.to_le_bytes());
    h.extend_from_slice(&width.to_le_bytes());
    h.extend_from_slice(&count.to_le_bytes());
    h.extend_from_slice(&vocab.to_le_bytes());
    h.extend_from_slice(&0u32.to_le_bytes());
    h
}

#[test]
fn shard_layout_is_as_documented() {
    let dir = temp_dir("shard");
    let p = dir.join("a.tok");
    write_shard(&p, &[1, 2, 300], 65536).unwrap();
    let bytes = std::fs::read(&p).unwrap();
    let mut expect = shard_header(2, 3, 65536);
    expect.extend_from_slice(&le(&[1u16, 2, 300], u16::to_le_bytes));
    assert_eq!(bytes, expect);
    write_shard(&p, &[1, 2, 70000], 100_000).unwrap();
    let bytes = std::fs::read(&p).unwrap();
    let mut expect = shard_header(4, 3, 100_000);
    expect.extend_from_slice(&le(&[1u32, 2, 70000], u32::to_le_bytes));
    assert_eq!(bytes, expect);
    let (t, vocab) = read_shard(&p).unwrap();
    assert!(t.is_mapped());
    assert_eq!((t.to_vec(), vocab), (vec![1, 2, 70000], 100_000));
    // A header-only shard (0 tokens) is valid.
    write_shard(&p, &[], 256).unwrap();
    assert_eq!(read_shard(&p).unwrap().0.len(), 0);
}

#[test]
fn shard_errors_name_the_file() {
    let dir = temp_dir("shardbad");
    let p = dir.join("x.tok");
    let name = p.to_str().unwrap();
    let mut trunc = shard_header(2, 10, 256);
    trunc.extend_from_slice(&[0u8; 6]);
    let mut bad_id = shard_header(2, 2, 256);
    bad_id.extend_from_slice(&le(&[5u16, 300], u16::to_le_bytes));
    let mut bad_version = shard_header(2, 0, 256);
    bad_version[8] = 9;
    let cases: Vec<(Vec<u8>, &str)> = vec![
        (trunc, "52 bytes expected, but the file has 38"),
        (bad_id, "index 1 is 300"),
        (bad_version, "version 9"),
        (shard_header(3, 0, 256), "dtype 3"),
        (b"KILNTOK\0\x01\0".to_vec(), "truncated"),
        (b"NOTATOKFILE_____________________".to_vec(), "magic"),
    ];
    for (bytes, needle) in cases {
        std::fs::write(&p, &bytes).unwrap();
        let msg = assert_names(read_shard(&p).unwrap_err(), name);
        assert!(msg.contains(needle), "expected {needle:?} in {msg:?}");
    }
    assert_names(write_shard(&p, &[256], 256).unwrap_err(), name);
    assert_names(read_shard(&dir.join("nope.tok")).unwrap_err(), "nope.tok");
}

#[test]
fn tokens_views_share_storage() {
    let t = Tokens::from_vec((0..100).collect());
    let (a, b) = t.split_at(90);
    assert_eq!((a.len(), b.len()), (90, 10));
    assert_eq!(b.get(0), 90);
    let s = a.slice(10, 20);
    let mut out = [0u32; 3];
    s.copy_to(7, &mut out);
    assert_eq!(out, [17, 18, 19]);
    assert_eq!(t.max_id(), Some(99));
    assert_eq!(t.find_at_or_above(50), Some((50, 50)));
    let _ = Path::new("");
}

#[test]
#[should_panic(expected = "out of range")]
fn tokens_copy_past_end_panics() {
    let t = Tokens::from_vec(vec![1, 2, 3]);
    let mut out = [0u32; 2];
    t.copy_to(2, &mut out);
}
