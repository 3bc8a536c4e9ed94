/* Writing a short text file whole, for the holder and the cffi module. */
#ifndef SBX_TEXT_FILE_H
#define SBX_TEXT_FILE_H

/* Write text to path (opened with O_WRONLY | O_CLOEXEC | extra_flags, mode
 * 0644 if created) in one write: 0, or -errno. One write matters for the
 * /proc files it serves (uid_map, setgroups, sysctls), which take a value
 * only whole. */
int write_text_file(const char *path, const char *text, int extra_flags);

#endif
